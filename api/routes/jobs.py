"""Jobs: submit, list, show, cancel."""

from __future__ import annotations

import logging
import re
from contextlib import AbstractContextManager
from threading import Event
from typing import Annotated, Any, NamedTuple

from fastapi import APIRouter, Query, Request, Response, status
from fastapi.responses import JSONResponse
from sqlalchemy import Connection, Engine, select, tuple_
from sqlalchemy.orm import Session, defer, sessionmaker
from starlette.concurrency import run_in_threadpool

from api.deps import (
    CallerDep,
    EngineDep,
    EnqueueDep,
    Enqueuer,
    OwnedJob,
    SessionDep,
    SessionFactoryDep,
    SettingsDep,
    get_app_settings,
    get_engine,
    get_enqueuer,
    get_session_factory,
    owned_dataset,
)
from api.estimation import (
    budget_for,
    check_monthly_budget,
    estimate_for_submit,
    liger_errors,
    multi_node_errors,
    plan,
    resolve_auto_for_submit,
    time_estimate,
    with_cost,
)
from api.fast_path import FastPath
from api.idempotency import (
    KEY_HEADER,
    KEY_PATTERN,
    Idempotency,
    IdempotencyKeyHeader,
    KeyTaken,
    exit_if_asked,
    fingerprint,
)
from api.init_from import resolve_init_from
from api.paths import check_spec_locations, readable_here, resolve_uploaded_dataset, store_root
from api.preflight import run_preflight
from api.problems import Problem
from api.quotas import check_queued_quota
from api.schemas.common import problem_responses
from api.schemas.jobs import CURSOR_PATTERN, Cursor, JobCreate, JobList, JobOut, JobSummary, NodeOut
from api.schemas.preflight import DryRunOut
from api.spec_limits import runtime_limited
from service_core.db.base import utcnow
from service_core.db.jobstore import insert_job, insert_plain_job, transition
from service_core.db.models import Job, JobEvent, JobNode
from service_core.keys import Caller
from service_core.settings import Settings
from service_core.status import ErrorReason, JobStatus
from trainer_core.spec import FieldError, JobSpec, SpecError, untrainable_errors
from trainer_core.spec_integrations import tracking_uri_problem

logger = logging.getLogger(__name__)
router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=problem_responses(401, 404, 422))
# The jobs started from one job's checkpoints that it lists (`continued_by`, the oldest first).
MAX_CONTINUED = 100


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=JobOut,
    responses={
        **problem_responses(409, 413, 429, 503),  # 409: a race on one Idempotency-Key (api/idempotency.py)
        200: {"model": DryRunOut, "description": "`dry_run=true`: the checks"},
    },
)
async def submit_job(
    body: JobCreate,
    engine: EngineDep,
    sessions: SessionFactoryDep,
    settings: SettingsDep,
    caller: CallerDep,
    enqueue: EnqueueDep,
    request: Request,
    response: Response,
    idempotency_key: IdempotencyKeyHeader = None,
    dry_run: Annotated[bool, Query(description="Run preflight and the estimate only; store nothing.")] = False,
) -> JobOut | JSONResponse:
    """Validate, estimate, preflight, store and enqueue a job; nothing is stored when any check fails.

    A spec of the documented shape can still be a 422 naming the field: its data and model must exist
    and load (preflight), an uploaded `dataset.id` must be the caller's, cross-field rules hold
    (e.g. `efficiency.local_sgd_steps` needs `training.backend: accelerate`), and an `Idempotency-Key`
    used in the last 24 h must come with the same body (a dry run ignores the key).
    """
    # All the blocking work in one threadpool call: as a plain `def` route with a session dependency
    # it took four hand-offs (session open, call, response validation, session close).
    warmed_up = request.app.state.warmed_up
    if dry_run:
        report = await run_in_threadpool(check_job, body, sessions, settings, caller, warmed_up)
        return JSONResponse(report.model_dump(mode="json"))
    keyed = Idempotency.of(caller.owner, idempotency_key)
    job = await run_in_threadpool(create_job, body, engine, sessions, settings, caller, enqueue, warmed_up, keyed)
    if isinstance(job, JSONResponse):  # the first answer to this Idempotency-Key
        return job
    response.headers["Location"] = f"/v1/jobs/{job.id}"
    return job


def _usual_key(request: Request) -> bool:
    """No Idempotency-Key, or one the header's pattern takes (FastAPI's route names a wrong one)."""
    sent = request.headers.getlist(KEY_HEADER)
    return not sent or (len(sent) == 1 and re.fullmatch(KEY_PATTERN, sent[0]) is not None)


async def _serve_submit(request: Request, body: JobCreate, caller: Caller, response: Response) -> JobOut | JSONResponse:
    return await submit_job(
        body, await get_engine(request), await get_session_factory(request), await get_app_settings(request), caller,
        await get_enqueuer(request), request, response, request.headers.get(KEY_HEADER),
    )  # fmt: skip


# api/fast_path.py: why, and which requests FastAPI's route serves instead (a dry run among them)
FAST_PATHS = [FastPath("POST", "/v1/jobs", JobCreate, JobOut, _serve_submit, status_code=201, accepts=_usual_key)]


class Checked(NamedTuple):
    """A submit's spec after every check: as it would be stored (locations resolved, `auto` chosen)."""

    spec: JobSpec
    queue: str
    dataset_id: str | None
    estimate: dict[str, Any] | None
    report: dict[str, Any]
    auto: list[dict[str, Any]]


def checked_spec(
    body: JobCreate, sessions: sessionmaker[Session], settings: Settings, caller: Caller, warmed_up: Event | None
) -> Checked:
    """Every check a submit makes, in order (locations, preflight, `auto` values, budget); a
    Problem/SpecError on failure."""
    spec = body.job_spec()
    untrainable = untrainable_errors(spec, cuda=True)  # the worker's device is checked by the run
    if untrainable:  # estimates take these specs; the worker cannot run them yet
        raise SpecError(untrainable)
    mlflow = spec.integrations.mlflow if spec.integrations else None
    uri = mlflow.tracking_uri if mlflow else None  # the run connects there, from the worker
    if uri is not None and (problem := tracking_uri_problem(uri, allow_private=settings.allow_private_targets)):
        raise SpecError([FieldError("integrations.mlflow.tracking_uri", problem)])
    spec = runtime_limited(spec, settings.max_job_hours)
    spec = resolve_init_from(spec, sessions, settings, caller)  # before preflight: a refusal costs nothing
    queue = body.queue or settings.default_queue
    if liger := liger_errors(spec, queue, settings, sessions):
        raise SpecError(liger)
    if nodes := multi_node_errors(spec, queue, settings, sessions):
        raise SpecError(nodes)
    dataset_id = None
    if spec.dataset.id is not None:
        with sessions() as session:
            dataset = owned_dataset(session, spec.dataset.id, caller, field="dataset.id")
            dataset_id = dataset.id
        spec = resolve_uploaded_dataset(spec, dataset, settings.data_root_url)
    spec = check_spec_locations(spec, settings.data_root_url, None if caller.is_admin else caller.owner)
    here = readable_here(spec, settings)  # a model folder on an object-store data root: this host's copy
    # Preflight first: its messages about the data and the model say more than the estimator's would.
    report = run_preflight(here, warmed_up, store_root=store_root(settings))
    spec, here, auto = resolve_auto_for_submit(spec, here, queue, report.get("train_rows"), settings, sessions)
    estimate = estimate_for_submit(here, queue, settings, sessions)
    if estimate is not None:  # the time part needs the model the memory estimate sized, and the rows
        rows = report.get("train_rows"), report.get("eval_rows") or 0
        timed = time_estimate(here, queue, *rows, settings, sessions, report.get("sample_tokens"))
        estimate["time"] = with_cost(timed, spec, queue, settings)
    check_monthly_budget(caller.owner, estimate, spec, settings, sessions)
    return Checked(spec, queue, dataset_id, estimate, report, auto)


def check_job(
    body: JobCreate, sessions: sessionmaker[Session], settings: Settings, caller: Caller, warmed_up: Event | None
) -> DryRunOut:
    """A dry run: the checks of :func:`create_job`, answered as a report, storing nothing."""
    spec, queue, _, estimate, report, auto = checked_spec(body, sessions, settings, caller, warmed_up)
    budget = budget_for(spec, queue, settings)
    advice = None
    if budget is not None and estimate is not None:
        advice = plan(readable_here(spec, settings), budget).model_dump(mode="json")
    return DryRunOut(
        queue=queue,
        spec=spec.model_dump(mode="json", exclude_unset=True),
        preflight=report,
        estimate=estimate,
        budget_gb=budget,
        plan=advice,
        auto=auto or None,
    )


def create_job(
    body: JobCreate,
    engine: Engine,
    sessions: sessionmaker[Session],
    settings: Settings,
    caller: Caller,
    enqueue: Enqueuer,
    warmed_up: Event | None = None,
    keyed: Idempotency | None = None,
) -> JobOut | JSONResponse:
    """Check, store and enqueue ``body`` for ``caller`` (blocking); a Problem when a check fails. With
    ``keyed`` (an Idempotency-Key), the first answer to that key when there is one (api/idempotency.py)."""
    request = ""
    if keyed is not None:
        request = fingerprint("POST", "/v1/jobs", body.model_dump(mode="json", exclude_unset=True))
        with engine.connect() as conn:
            if (answer := keyed.answer(conn, lambda: request)) is not None:
                return answer
    spec, queue, dataset_id, estimate, _, auto = checked_spec(body, sessions, settings, caller, warmed_up)
    now = utcnow()
    values = {
        "owner": caller.owner, "name": spec.name, "queue": queue, "priority": body.priority,
        "spec": spec.model_dump(mode="json", exclude_unset=True), "estimate": estimate, "dataset_id": dataset_id,
        "created_at": now, "enqueued_at": now, "reads_all_uploads": caller.is_admin,
        "devices": spec.world_size, "nodes": spec.resources.num_nodes,
        "price_per_device_hour": settings.queue_prices.get(queue),
        "auto_choices": auto or None, "init_from_job": spec.init_from.job if spec.init_from else None,
    }  # fmt: skip
    try:
        job = store_job(engine, settings, values, keyed, request)
    except KeyTaken:
        assert keyed is not None
        with engine.connect() as conn:
            return keyed.after_race(conn, request)
    exit_if_asked()  # a testing aid: the API dies between its commit and its answer
    try:
        enqueue(job.id, queue, body.priority, settings)
    except Exception as exc:
        # The job was never handed to a worker: fail it visibly rather than leave it queued forever, and
        # forget its key, so that a retry creates the job this answer says was not started.
        logger.exception("enqueue of job %s failed", job.id)
        with sessions() as session:
            transition(
                session, job.id, JobStatus.failed, reason=ErrorReason.internal,
                message=f"the queue could not take the job: {exc}", expect=JobStatus.queued,
            )  # fmt: skip
            if keyed is not None:
                keyed.forget(session.connection())
            session.commit()
        raise Problem(503, "the queue is unreachable; the job was not started, submit it again later") from exc
    return JobOut.from_job(job)


def store_job(
    engine: Engine, settings: Settings, values: dict[str, Any], keyed: Idempotency | None, request: str
) -> Job:
    """INSERT the job (within the queued-jobs quota), with its answer under ``keyed`` in the same transaction.

    The row is its own outbox record: stamped as sent by its INSERT (no second round trip), so a crash
    before the send leaves a queued job the workers' sweep sends again. Without a key: one autocommit
    INSERT, stored (or not) by that statement alone, so no transaction.
    """
    scope: AbstractContextManager[Connection] = (
        engine.begin() if keyed is not None else engine.connect().execution_options(isolation_level="AUTOCOMMIT")
    )
    with scope as conn:
        job = insert_plain_job(conn, settings.max_queued_per_owner, **values)  # one statement, mostly
        if job is None:  # over the quota (a 429 here), or the owner has webhooks to queue deliveries for
            check_queued_quota(conn, values["owner"], settings.max_queued_per_owner)
            job = insert_job(conn, **values)
        if keyed is not None:
            answer = JobOut.from_job(job).model_dump(mode="json")
            keyed.record(conn, request, status.HTTP_201_CREATED, answer, {"Location": f"/v1/jobs/{job.id}"})
    return job


@router.get("", response_model=JobList, responses=problem_responses(403))
def list_jobs(
    session: SessionDep,
    caller: CallerDep,
    status_: Annotated[JobStatus | None, Query(alias="status")] = None,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[
        str | None, Query(pattern=CURSOR_PATTERN, description="`next_cursor` of the previous page.")
    ] = None,
    owner: Annotated[
        str | None, Query(max_length=128, description="Only this owner's jobs (another owner's: admin keys only).")
    ] = None,
) -> JobList:
    """The caller's jobs (an admin's: everyone's, or one owner's), newest first, in keyset-paginated pages."""
    if owner is not None and owner != caller.owner and not caller.is_admin:
        raise Problem(
            403,
            "owner: only an admin key may list another owner's jobs",
            errors=[{"field": "owner", "message": "not your own owner name", "type": "forbidden"}],
        )
    # Lists carry no specs (up to the body limit each): the spec is not even read.
    query = select(Job).options(defer(Job.spec))
    if not caller.is_admin or owner is not None:
        query = query.where(Job.owner == (owner or caller.owner))
    if status_ is not None:
        query = query.where(Job.status == status_.value)
    if cursor is not None:
        after = Cursor.decode(cursor)
        # A row value, not `a < x OR (a = x AND b < y)`: PostgreSQL turns it into one index range
        # (jobs(created_at, id)) instead of reading and discarding every newer entry (bench_history).
        query = query.where(tuple_(Job.created_at, Job.id) < tuple_(after.created_at, after.id))
    rows = session.execute(query.order_by(Job.created_at.desc(), Job.id.desc()).limit(limit + 1)).scalars().all()
    page = list(rows[:limit])
    next_cursor = Cursor(created_at=page[-1].created_at, id=page[-1].id).encode() if len(rows) > limit else None
    return JobList(items=[JobSummary.from_job(job) for job in page], next_cursor=next_cursor)


@router.get("/{job_id}", response_model=JobOut)
def get_job(job: OwnedJob, session: SessionDep) -> JobOut:
    """Status, progress, latest and final metrics, estimated and measured memory, error, retries, timestamps."""
    out = JobOut.from_job(job)
    continued = select(Job.id).where(Job.init_from_job == job.id).order_by(Job.created_at, Job.id)
    out.continued_by = list(session.execute(continued.limit(MAX_CONTINUED)).scalars())
    retries = select(JobEvent.data).where(JobEvent.job_id == job.id, JobEvent.kind == "retry").order_by(JobEvent.seq)
    out.retries = [dict(data) for data in session.execute(retries).scalars()]
    if job.nodes > 1:  # the running attempt's gang, or the one forming for the next
        attempt = job.attempts if job.status == JobStatus.running.value else job.attempts + 1
        rows = session.execute(select(JobNode).where(JobNode.job_id == job.id, JobNode.attempt == attempt)
                               .order_by(JobNode.node, JobNode.joined_at)).scalars()  # fmt: skip
        out.nodes = [NodeOut(node=row.node, host=row.host, worker=row.worker, address=row.address, port=row.port)
                     for row in rows]  # fmt: skip
    return out


@router.post(
    "/{job_id}/cancel",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=JobOut,
    responses=problem_responses(409),
)
def cancel_job(job: OwnedJob, session: SessionDep, caller: CallerDep) -> JobOut:
    """Cancel: a queued or paused job at once; a running one is stopped by its slot at its next step."""
    message = f"cancelled by {caller.owner}"
    waiting = JobStatus(job.status)
    if waiting in (JobStatus.queued, JobStatus.paused) and transition(
        session, job.id, JobStatus.cancelled, reason=ErrorReason.cancelled, message=message, expect=waiting
    ):
        session.commit()
    else:
        session.rollback()
        session.refresh(job)
        current = JobStatus(job.status)
        if current.terminal:
            raise Problem(409, f"job {job.id} already {current.value}", job_status=current.value)
        if current == JobStatus.paused:  # paused by a racing pause just now: cancel it from there
            transition(session, job.id, JobStatus.cancelled, reason=ErrorReason.cancelled, message=message,
                       expect=JobStatus.paused)  # fmt: skip
        # Running (or just claimed): the worker watches this flag, SIGTERMs the run, then SIGKILLs. Set in
        # every case: a job that a racing resume just queued again is then cancelled when it is claimed.
        job.cancel_requested = True
        session.commit()
    session.refresh(job)
    return JobOut.from_job(job)


@router.post(
    "/{job_id}/pause",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=JobOut,
    responses=problem_responses(409),
)
def pause_job(job: OwnedJob, session: SessionDep, caller: CallerDep) -> JobOut:
    """Pause: a queued job at once; a running one checkpoints at its next step, stops and frees its slot,
    then becomes ``paused``. A paused job waits for ``resume``, off the queue and outside the quotas."""
    message = f"paused by {caller.owner}"
    if JobStatus(job.status) == JobStatus.queued and transition(
        session, job.id, JobStatus.paused, reason=ErrorReason.paused, message=message, expect=JobStatus.queued,
        enqueued_at=None, waiting_reason=None, pause_requested=False,
    ):  # fmt: skip
        session.commit()
    else:
        session.rollback()
        session.refresh(job)
        current = JobStatus(job.status)
        if current.terminal or job.cancel_requested:
            state = "being cancelled" if not current.terminal else current.value
            raise Problem(409, f"job {job.id} is {state}: it cannot be paused", job_status=current.value)
        if current == JobStatus.running:  # its slot watches the flag (worker/supervisor.py)
            job.pause_requested = True
            session.commit()
    session.refresh(job)
    return JobOut.from_job(job)


@router.post(
    "/{job_id}/resume",
    status_code=status.HTTP_202_ACCEPTED,
    response_model=JobOut,
    responses=problem_responses(409, 429),
)
def resume_job(
    job: OwnedJob, session: SessionDep, caller: CallerDep, settings: SettingsDep, enqueue: EnqueueDep
) -> JobOut:
    """Resume a paused job: back on its queue, to continue from the checkpoint its pause took (the same
    step, schedule and data position). Counts against the queued-jobs quota like a submit."""
    if JobStatus(job.status) != JobStatus.paused:
        raise Problem(409, f"job {job.id} is {job.status}, not paused", job_status=job.status)
    check_queued_quota(session.connection(), job.owner, settings.max_queued_per_owner)
    now = utcnow()
    if not transition(session, job.id, JobStatus.queued, expect=JobStatus.paused, message=f"resumed by {caller.owner}",
                      enqueued_at=now, pause_requested=False):  # fmt: skip
        session.rollback()
        session.refresh(job)
        raise Problem(409, f"job {job.id} is {job.status}, not paused", job_status=job.status)
    session.commit()
    try:
        enqueue(job.id, job.queue, job.priority, settings)
    except Exception:  # queued and stamped: the sweep sends lost messages again (worker/sweeper.py)
        logger.exception("enqueue of resumed job %s failed; the sweep will send it", job.id)
    session.refresh(job)
    return JobOut.from_job(job)
