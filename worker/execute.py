"""What a slot does with one job id: claim it, execute the attempt, record how it ended, store its artifacts.

Plain functions (the Celery task only calls :func:`execute_job`), so tests and the dev launcher run
them without a broker. The claim is a compare-and-set ``queued -> running``: a redelivered message
for a job that is running elsewhere or already finished changes nothing.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, NamedTuple

from sqlalchemy import select
from sqlalchemy.orm import Session

from service_core.artifacts import ArtifactStore
from service_core.checkpoints import CheckpointError, fetch_checkpoint
from service_core.datastore import FetchError, localize_spec
from service_core.db.base import utcnow
from service_core.db.jobstore import FencedOut, transition
from service_core.db.models import Job
from service_core.db.session import session_scope
from service_core.runs import RUN_LOG_NAME, node_log_name
from service_core.settings import Settings
from service_core.status import ErrorReason, JobStatus
from trainer_core.checkpoint import CHECKPOINT_PREFIX
from trainer_core.launch import OTHER_NODE
from trainer_core.path_guard import Reach
from worker import gang
from worker.checkpoint_sync import resume_phrase, start_uploader, store_checkpoint_events
from worker.db_retry import retry_database
from worker.gang import Gang
from worker.lease import LeaseKeeper
from worker.oom_retry import retry_after_oom
from worker.outcome import RunOutcome
from worker.paths import RunPaths, host_name, run_paths, run_reach
from worker.recovery import requeue_or_fail
from worker.restarts import RESTARTABLE, max_restarts, prepare_resume, restarts_used
from worker.running_cap import hold, lock_owner_claims, resend_waiting, running_count, waiting_message
from worker.supervisor import supervise_run, user_stop

log = logging.getLogger(__name__)


class Claimed(NamedTuple):
    """A claimed attempt: its number (the fencing token), the job's spec and estimate, what its run may
    read, the job (a slot joining gangs may end up in an older job's than its message named) and, for a
    job of several nodes, this slot's place in the gang."""

    attempt: int
    spec: dict[str, Any]
    estimate: dict[str, Any] | None
    reach: Reach
    job_id: str
    gang: Gang | None = None

# How long a claim waits for an unavailable database before the delivery is given up (the job stays
# queued; the sweep sends it again).
CLAIM_BUDGET_S = 60.0


def session_factory(settings: Settings) -> Callable[[], Any]:
    @contextmanager
    def factory() -> Iterator[Session]:
        with session_scope(settings.database_url) as session:
            yield session

    return factory


def claim_job(session: Session, job_id: str, lease_s: float = 60.0, max_running: int = 0) -> int | None:
    """Move a queued job to running for this slot (its host and pid), with a lease of ``lease_s``.

    Returns the attempt number it claimed (the fencing token of every later write), or None when
    the job is not queued any more, or when its owner already runs ``max_running`` jobs (0: no cap):
    then the job stays queued, held until one of them ends (:mod:`worker.running_cap`).
    """
    owner = lock_owner_claims(session, job_id) if max_running > 0 else None
    moved = transition(
        session, job_id, JobStatus.running, expect=JobStatus.queued, attempts=Job.attempts + 1,
        worker=host_name(), pid=os.getpid(), lease_expires_at=utcnow() + timedelta(seconds=lease_s),
        waiting_reason=None, conditions=(Job.nodes <= 1,),  # a job of several nodes is joined (worker/gang.py)
    )  # fmt: skip
    if not moved:
        return None
    if owner is not None and (running := running_count(session, owner, excluding=job_id)) >= max_running:
        session.rollback()  # the claim, its event and the owner's lock
        hold(session, job_id, waiting_message(owner, running, max_running))
        log.info("job %s: held, %s runs %d jobs (TRAINJOBS_MAX_RUNNING_PER_OWNER)", job_id, owner, running)
        return None
    return int(session.execute(select(Job.attempts).where(Job.id == job_id)).scalar_one())


def final_metrics(summary: dict[str, Any], latest: dict[str, Any] | None) -> dict[str, Any] | None:
    """The run's final numbers: its train summary and final evaluation, flat."""
    out: dict[str, Any] = {}
    for part in ("train", "eval"):
        values = summary.get(part)
        if isinstance(values, dict):
            out.update({k: v for k, v in values.items() if isinstance(v, int | float) or v is None})
    if not out and latest:
        out = {k: v for k, v in latest.items() if k.startswith("eval_")}
    return out or None


def execute_job(job_id: str, settings: Settings, *, should_stop: Callable[[], bool] = lambda: False) -> str | None:
    """Claim one job and execute the attempt to its end; returns the status it ended in, or None when
    not claimed.

    ``should_stop`` is the slot shutting down (its worker stopping): the run checkpoints and the job
    goes back to the queue (``running -> queued``) to resume on the next slot, instead of being
    cancelled.
    """
    claimed = retry_database(lambda: claim(job_id, settings, should_stop), f"job {job_id}: claim", CLAIM_BUDGET_S)
    if claimed is None:
        return None
    job_id = claimed.job_id
    try:
        return execute_attempt(job_id, settings, claimed, should_stop)
    finally:
        if claimed.gang is not None:  # this node's place goes with its attempt
            try:
                with session_scope(settings.database_url) as session:
                    gang.release(session, job_id, gang.slot_name())
            except Exception:  # a stale row is removed by the next gang's join
                log.exception("job %s: releasing this node's place failed", job_id)
        if settings.max_running_per_owner > 0:  # a place under the cap may be free: send who waits for it
            try:
                resend_waiting(settings)
            except Exception:  # the sweep sends them later
                log.exception("job %s: sending jobs held by the running-jobs cap failed", job_id)


def fetch_run_data(
    job_id: str, settings: Settings, spec: dict[str, Any], paths: RunPaths
) -> dict[str, Any] | RunOutcome:
    """The spec the run gets: data and models on an object-store ``DATA_ROOT`` fetched into this host's
    cache (runs have no store credentials), and the checkpoint ``init_from`` names copied into the work
    dir; or the job's failure naming the field. The caller holds the attempt's lease meanwhile."""
    try:
        return fetch_init_from(localize_spec(spec, settings), settings, paths)
    except FetchError as exc:
        log.warning("job %s: %s", job_id, exc)
        return RunOutcome(JobStatus.failed, exc.reason, f"fetching the job's data failed: {exc}")
    except CheckpointError as exc:
        log.warning("job %s: init_from: %s", job_id, exc)
        return RunOutcome(JobStatus.failed, ErrorReason.model_error, f"init_from.checkpoint: {exc}")


def fetch_init_from(spec: dict[str, Any], settings: Settings, paths: RunPaths) -> dict[str, Any]:
    """``spec`` with ``init_from.path`` set to this run's copy of the checkpoint its ``job`` and step
    name (the submit resolved `best` and `last` to a step); unchanged without ``init_from``."""
    init = spec.get("init_from")
    if not init or not init.get("job"):
        return spec
    parent, step = str(init["job"]), int(init["checkpoint"])
    dest = paths.work_dir / "init_from" / f"{parent}-{step}"
    fetch_checkpoint(settings.artifacts_root, parent, step, dest, with_optimizer=bool(init.get("resume_optimizer")))
    return {**spec, "init_from": {**init, "path": str(dest)}}


def execute_attempt(
    job_id: str, settings: Settings, claimed: Claimed, should_stop: Callable[[], bool]
) -> str | None:
    """Carry out a claimed attempt (its number, spec, estimate and reach): fetch the data, supervise the
    run, then record how it ended or requeue the job (see execute_job)."""
    attempt, spec, estimate, reach, _, place = claimed
    paths = run_paths(job_id, settings, reach)
    paths.work_dir.mkdir(parents=True, exist_ok=True)
    # One lease from the claim to the run's end: a first fetch of a large dataset, or of the checkpoint a
    # restart resumes from, may take longer than the lease. A node of a gang renews its own row, since
    # the job's lease is its nodes' earliest: a node that renewed only the job's would let its row run
    # out while it fetched, and the next renewal of another node would set the job's lease to that
    # past time, for the sweep to requeue the gang.
    lease = LeaseKeeper(job_id, attempt, settings, slot=gang.slot_name() if place is not None else None).start()
    try:
        local_spec = fetch_run_data(job_id, settings, spec, paths)
        if not isinstance(local_spec, RunOutcome):
            paths.spec_file.write_text(json.dumps(local_spec, indent=2), encoding="utf-8")
            resume = retry_database(lambda: prepare_resume(job_id, settings, paths, attempt),
                                    f"job {job_id}: prepare resume")  # fmt: skip
    except BaseException:
        lease.stop()
        raise
    if isinstance(local_spec, RunOutcome):  # a data file or model folder on the store could not be fetched
        lease.stop()  # before the outcome, which ends the lease
        lease.confirm()
        if lease.fenced.is_set():
            return None
        failed = local_spec
        return retry_database(lambda: record_outcome(job_id, settings, failed, attempt), f"job {job_id}: outcome")
    log.info("job %s: attempt %d running in %s (resume=%s)", job_id, attempt, paths.output_dir, resume)
    uploader = None
    try:
        uploader = start_uploader(job_id, settings, paths, spec, attempt)
        outcome = supervise_run(
            job_id, paths, session_factory(settings), resume=resume, grace_s=settings.cancel_grace_seconds,
            should_stop=should_stop, estimate=estimate, attempt=attempt,
            watch=uploader.poll if uploader is not None else None,
            on_checkpoint=uploader.describe if uploader is not None else None,
            rendezvous=place.rendezvous(job_id) if place is not None else None,
            extra_env=gang.run_env(place) if place is not None else None,
        )  # fmt: skip
    except FencedOut:  # the ingestor already killed the run (worker/ingest.py)
        lease.fenced.set()
    except Exception as exc:
        log.exception("job %s: supervising the run failed", job_id)
        outcome = RunOutcome(JobStatus.failed, ErrorReason.internal,
                             f"the slot failed supervising the run: {type(exc).__name__}: {exc}")  # fmt: skip
    finally:
        if uploader is not None:  # under the lease: the last checkpoint is stored before any requeue
            uploader.finish(abort=lease.fenced.is_set())
        lease.stop()
    lease.confirm()
    if lease.fenced.is_set():  # a newer attempt owns the job now: write nothing, upload nothing
        if place is not None:  # but its own log, as node-K.log, which nothing else writes
            store_node_log(job_id, settings, paths, place.node)
        return None
    if uploader is not None:
        store_checkpoint_events(settings, job_id, attempt, uploader.announcements(final=True))
    if place is not None:
        store_node_log(job_id, settings, paths, place.node)
        asked = None
        if outcome.status == JobStatus.failed and outcome.stopped_by is None:  # a stop its poll had not seen yet?
            asked = retry_database(lambda: user_stop(session_factory(settings), job_id), f"job {job_id}: stop flags")
        node_ended = gang.node_outcome(outcome, asked)
        if node_ended is None:  # its ranks finished; the node holding rank 0 records the job's end
            log.info("job %s: node %d finished its part", job_id, place.node)
            return None
        outcome = node_ended
    if outcome.stopped_by == ErrorReason.paused and outcome.status == JobStatus.cancelled:  # stopped as asked
        return retry_database(lambda: pause_after_stop(job_id, settings, paths, attempt), f"job {job_id}: pause")
    if outcome.stopped_by == ErrorReason.shutdown_requeue:
        requeue = lambda: requeue_after_shutdown(job_id, settings, paths, outcome, attempt)  # noqa: E731
        return retry_database(requeue, f"job {job_id}: requeue")
    if outcome.status == JobStatus.failed and outcome.reason in RESTARTABLE:
        restarted = retry_database(lambda: restart(job_id, settings, paths, outcome, spec, attempt),
                                   f"job {job_id}: restart")  # fmt: skip
        if restarted:
            return JobStatus.queued.value
    if outcome.reason == ErrorReason.out_of_memory:
        retried = retry_database(lambda: retry_after_oom(job_id, settings, outcome, attempt),
                                 f"job {job_id}: out-of-memory retry")  # fmt: skip
        if retried is None:
            return JobStatus.queued.value
        outcome = retried
    if place is None or not outcome.summary.get(OTHER_NODE):  # a gang's outputs are its rank 0 node's
        store_artifacts(job_id, settings, paths)
    return retry_database(lambda: record_outcome(job_id, settings, outcome, attempt), f"job {job_id}: outcome")


def claim(job_id: str, settings: Settings, should_stop: Callable[[], bool] = lambda: False) -> Claimed | None:
    """Claim the job; its attempt, spec, estimate and what its run may read, or None when this delivery
    is not the one to run it. A job of several nodes is joined instead, and starts once its gang forms."""
    with session_scope(settings.database_url) as session:
        attempt = claim_job(session, job_id, settings.lease_seconds, settings.max_running_per_owner)
        if attempt is not None:
            job = session.execute(select(Job).where(Job.id == job_id)).scalar_one()
            reach = run_reach(settings, job.owner, job.reads_all_uploads)
            return Claimed(attempt, dict(job.spec), job.estimate, reach, job_id)
        row = session.execute(select(Job.status, Job.nodes).where(Job.id == job_id)).one_or_none()
    if row is None or row.nodes <= 1 or row.status != JobStatus.queued.value:
        log.info("job %s not claimed (status %s): ignoring this delivery", job_id, row and row.status)
        return None
    formed = gang.claim_gang(job_id, settings, should_stop=should_stop)
    if formed is None:
        return None
    job_id, place = formed
    with session_scope(settings.database_url) as session:
        job = session.execute(select(Job).where(Job.id == job_id)).scalar_one()
        reach = run_reach(settings, job.owner, job.reads_all_uploads)
        return Claimed(place.attempt, dict(job.spec), job.estimate, reach, job_id, place)


def restart(
    job_id: str,
    settings: Settings,
    paths: RunPaths,
    outcome: RunOutcome,
    spec: dict[str, Any],
    attempt: int | None = None,
) -> bool:
    """Requeue after an infrastructure failure while the job has restarts left (:mod:`worker.restarts`).

    Without restarts left, ``outcome.message`` says so and the caller records the failure.
    """
    budget = max_restarts(spec)
    with session_scope(settings.database_url) as session:
        used = restarts_used(session, job_id)
    if used >= budget:
        outcome.message = f"{outcome.message} (no restarts left: resources.max_restarts is {budget})"
        return False
    resume = f"restarting {resume_phrase(settings, job_id, paths.output_dir)}, restart {used + 1} of {budget}"
    status = requeue_or_fail(job_id, settings, may_requeue=True, message=outcome.message or "", resume=resume,
                             requeue_reason=ErrorReason.worker_lost, attempt=attempt)  # fmt: skip
    if status == JobStatus.queued.value:
        log.warning("job %s: %s; %s", job_id, outcome.message, resume)
    return status == JobStatus.queued.value


def record_outcome(job_id: str, settings: Settings, outcome: RunOutcome, attempt: int | None = None) -> str:
    """Write the terminal status; a status some other writer already made terminal is left alone.

    ``attempt`` fences the write: a stale attempt's outcome is refused (and logged).
    """
    with session_scope(settings.database_url) as session:
        latest = session.execute(select(Job.latest_metrics).where(Job.id == job_id)).scalar_one_or_none()
        new = outcome.status
        reason = outcome.reason if new != JobStatus.succeeded else None
        moved = transition(
            session, job_id, new, expect=JobStatus.running, reason=reason, message=outcome.message,
            final_metrics=final_metrics(outcome.summary, latest), pid=None, attempt=attempt,
        )  # fmt: skip
        current = session.execute(select(Job.status).where(Job.id == job_id)).scalar_one()
    if not moved:
        log.warning("job %s: run (attempt %s) ended %s but the job is already %s%s", job_id, attempt,
                    outcome.status, current, "" if attempt is None else "; write refused")  # fmt: skip
    log.info("job %s: %s%s", job_id, current, f" ({outcome.reason})" if outcome.reason else "")
    return str(current)


def requeue_after_shutdown(
    job_id: str, settings: Settings, paths: RunPaths, outcome: RunOutcome, attempt: int | None = None
) -> str:
    """The slot is stopping: put the job back to resume from its checkpoint, or from the start when it
    has none yet. A stop is no fault of the job's (a deploy, or the worker process gone), so it spends
    none of its restarts; failing it lost every job that had not reached its first checkpoint (the
    chaos bench, R9: the worker process killed while runs were still loading their model)."""
    resume = f"it runs again {resume_phrase(settings, job_id, paths.output_dir)}"
    status = requeue_or_fail(job_id, settings, may_requeue=True, message="the worker shut down while the job ran",
                             resume=resume, requeue_reason=ErrorReason.shutdown_requeue, attempt=attempt)  # fmt: skip
    if status != JobStatus.queued.value:
        store_artifacts(job_id, settings, paths)
    return status


def pause_after_stop(job_id: str, settings: Settings, paths: RunPaths, attempt: int | None = None) -> str:
    """The run checkpointed and stopped for a pause: ``running -> paused``, off the queue until a resume.
    A cancel asked meanwhile wins: the job is cancelled instead."""
    with session_scope(settings.database_url) as session:
        cancel = session.execute(select(Job.cancel_requested).where(Job.id == job_id)).scalar_one()
        if cancel:
            new, reason, message = JobStatus.cancelled, ErrorReason.cancelled, "cancelled while pausing"
        else:
            resume = resume_phrase(settings, job_id, paths.output_dir)
            new, reason, message = JobStatus.paused, ErrorReason.paused, f"paused; a resume continues {resume}"
        moved = transition(session, job_id, new, expect=JobStatus.running, reason=reason, message=message,
                           attempt=attempt, worker=None, pid=None, pause_requested=False)  # fmt: skip
        current = session.execute(select(Job.status).where(Job.id == job_id)).scalar_one()
    if new == JobStatus.cancelled and moved:
        store_artifacts(job_id, settings, paths)
    log.info("job %s: %s (%s)", job_id, current, message)
    return str(current)


def store_log(store: ArtifactStore, job_id: str, paths: RunPaths, name: str) -> None:
    """The run's log into the job's artifacts as ``name`` (when the run wrote one)."""
    if paths.log_file.is_file():
        store.fs.makedirs(store.job_dir(job_id), exist_ok=True)
        store.fs.put_file(str(paths.log_file), f"{store.job_dir(job_id)}/{name}")


def store_node_log(job_id: str, settings: Settings, paths: RunPaths, node: int) -> None:
    """Keep one node's run log beside the job's (``GET /v1/jobs/{id}/logs?node=K``); failures are logged."""
    try:
        store_log(ArtifactStore(settings.artifacts_root), job_id, paths, node_log_name(node))
    except OSError:
        log.exception("job %s: storing node %d's log failed", job_id, node)


def store_artifacts(job_id: str, settings: Settings, paths: RunPaths) -> None:
    """Upload the run's outputs (checkpoints stay behind) and its log; failures are logged, not fatal."""
    store = ArtifactStore(settings.artifacts_root)
    try:
        if paths.output_dir.is_dir():
            store.upload_dir(job_id, paths.output_dir, skip=(CHECKPOINT_PREFIX,))
        store_log(store, job_id, paths, RUN_LOG_NAME)
    except OSError:
        log.exception("job %s: storing artifacts failed", job_id)
