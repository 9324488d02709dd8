"""The worker slot's side of the checkpoint store (a remote ``ARTIFACTS_ROOT``): upload each checkpoint
as the run takes it, fetch the newest one when an attempt resumes.

Uploads live in the slot, not in the run, so runs never hold object-store credentials
(worker/run_env.py). The slot's watch loop calls :meth:`CheckpointUploader.poll`, which looks for a
newer complete checkpoint in the run's output folder (complete: ``trainer_core.checkpoint.META_FILE``
written last) and stages it by hard-linking its files into the run's work dir: the run's own rotation
(``save_total_limit``) may delete the original while the upload runs, and the staged links keep the
bytes. One background thread uploads (:class:`service_core.checkpoints.CheckpointStore`): at most one
upload in flight; a newer checkpoint waits behind it and replaces any older one still waiting, so
training never waits and the store gets the newest. The best so far (when retention keeps it, as the
newest checkpoint's description names it) is never replaced: it waits too, and one saved between two
looks at the folder is staged with the newest, so the store holds every checkpoint retention keeps.
When the run ends, :meth:`CheckpointUploader.finish` uploads what is pending before the slot records
the outcome or requeues the job.

The run's ``checkpoint`` event (step, epoch, loss) reaches the job's stream only once that checkpoint's
manifest is committed: the supervisor hands it to :meth:`CheckpointUploader.describe`, and
:meth:`CheckpointUploader.poll` returns it for storing after the commit (what commits after the run's
end is stored by :func:`store_checkpoint_events`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from service_core.checkpoints import CheckpointError, CheckpointStore
from service_core.db.jobstore import FencedOut, add_events, renew_lease
from service_core.db.session import DATABASE_UNAVAILABLE, session_scope
from service_core.settings import Settings
from trainer_core.best_checkpoint import protected_step
from trainer_core.checkpoint import CHECKPOINT_PREFIX, META_FILE, checkpoint_dir, newest_checkpoint, read_meta
from trainer_core.events import Event, make_event, utc_now_iso
from worker.ingest import event_data, event_time
from worker.paths import RunPaths, is_local_root

log = logging.getLogger(__name__)

POLL_S = 0.5
UPLOAD_NICENESS = 10


def stage(source: Path, target: Path) -> bool:
    """Hard-link every file of ``source`` under ``target`` (a copy where links are not possible).

    False (and nothing staged) when the run's rotation removed the folder, or part of it, meanwhile:
    the file list must hold the meta file and be the same after linking as before.
    """

    def listing() -> list[Path]:
        return sorted(p.relative_to(source) for p in source.rglob("*") if p.is_file())

    try:
        files = listing()
        for rel in files:
            dest = target / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(source / rel, dest)
            except FileNotFoundError:
                raise
            except OSError:  # another filesystem, or links not supported
                shutil.copy2(source / rel, dest)
        whole = Path(META_FILE) in files and listing() == files
    except FileNotFoundError:
        whole = False
    if not whole:
        shutil.rmtree(target, ignore_errors=True)
    return whole


class CheckpointUploader:
    """Upload a run's checkpoints from ``output_dir`` to ``store``, staged under ``staging_dir``."""

    def __init__(
        self, store: CheckpointStore, output_dir: Path, staging_dir: Path, *, attempt: int | None,
        keep: int | None, may_commit: Callable[[], bool] = lambda: True, commit_within_s: float | None = None,
    ) -> None:  # fmt: skip
        self.store, self.output_dir, self.staging_dir = store, output_dir, staging_dir
        self.attempt, self.keep, self.may_commit = attempt, keep, may_commit
        self.commit_within_s = commit_within_s
        self.last_staged = -1
        self.uploaded: list[int] = []  # steps committed to the store, in order
        self.stored: set[int] = set()  # steps the store holds (a resume's, and those committed since)
        self.unannounced: list[int] = []  # committed steps whose checkpoint event is not out yet
        self.described: dict[int, Event] = {}  # the run's checkpoint events, by step
        self.waiting: list[tuple[int, Path]] = []  # staged, oldest first: the best (if it waits) and the newest
        self.in_flight: int | None = None
        self.closing = False
        self.next_poll = 0.0
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self._upload_loop, name=f"upload {store.job_id}", daemon=True)

    def start(self) -> CheckpointUploader:
        """Start the upload thread; checkpoints the store already holds (a resume's) are not sent again."""
        shutil.rmtree(self.staging_dir, ignore_errors=True)  # a dead slot's leftovers
        try:
            self.stored = set(self.store.steps())
            self.last_staged = max(self.stored, default=-1)
        except OSError:  # the store is away: stage whatever comes; uploads retry with each checkpoint
            log.exception("job %s: listing stored checkpoints failed", self.store.job_id)
        self.thread.start()
        return self

    def describe(self, event: Event) -> None:
        """The run's ``checkpoint`` event for a step: announced once that step is in the store."""
        with self.changed:
            self.described[int(event["step"])] = event

    def announcements(self, *, final: bool = False) -> list[Event]:
        """The ``checkpoint`` events of the steps committed since the last call. A step whose event has
        not come from the run yet waits for it, unless ``final`` (the run has ended): then it is
        announced with its step alone."""
        out: list[Event] = []
        with self.changed:
            for step in list(self.unannounced):
                described = self.described.pop(step, None)
                if described is None and not final:
                    continue
                fields = {k: v for k, v in (described or {}).items() if k not in ("event", "time")}
                out.append({**make_event("checkpoint", **{"step": step, **fields}), "time": utc_now_iso()})
                self.unannounced.remove(step)
        return out

    def poll(self, *, force: bool = False) -> list[Event]:
        """Stage the newest complete checkpoint if it is newer than the last one staged (cheap: at most
        one folder listing every ``POLL_S``); returns the checkpoint events to store now."""
        self._stage_newest(force)
        return self.announcements()

    def _stage_newest(self, force: bool) -> None:
        now = time.monotonic()
        if not force and now < self.next_poll:
            return
        self.next_poll = now + POLL_S
        newest = newest_checkpoint(self.output_dir)
        if newest is None:
            return
        step = int(newest.name.rsplit("-", 1)[1])
        if step <= self.last_staged:
            return
        target = self.staging_dir / str(step)
        shutil.rmtree(target, ignore_errors=True)
        try:
            if not stage(newest, target):  # rotated away by the run while we linked: a newer one is there
                return
        except OSError:  # the disk is full, say: the run goes on, the next checkpoint tries again
            log.exception("job %s: staging checkpoint %d for upload failed", self.store.job_id, step)
            shutil.rmtree(target, ignore_errors=True)
            return
        self.last_staged = step
        staged = [(step, target)]
        best = protected_step(read_meta(target))
        with self.changed:
            pending = {waiting for waiting, _ in self.waiting} | {self.in_flight}
            if best is not None and best < step and best not in self.stored | pending:
                # Saved between two looks, so never staged: retention keeps it, so the store must hold it.
                best_target = self.staging_dir / str(best)
                shutil.rmtree(best_target, ignore_errors=True)
                with contextlib.suppress(OSError):
                    if stage(checkpoint_dir(self.output_dir, best), best_target):
                        staged.insert(0, (best, best_target))
            kept = [(waiting, folder) for waiting, folder in self.waiting if waiting == best]
            for waiting, folder in self.waiting:
                if waiting != best:  # never uploaded: the newer checkpoint supersedes it
                    log.info("job %s: checkpoint %d replaces %d waiting for upload", self.store.job_id, step,
                             waiting)  # fmt: skip
                    shutil.rmtree(folder, ignore_errors=True)
            self.waiting = [*kept, *staged]
            self.changed.notify_all()

    def _upload_loop(self) -> None:
        # Hashing and sending yield the CPU to the run on a busy host: its steps come first. On Linux
        # a thread id names this thread alone.
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), UPLOAD_NICENESS)
        while True:
            with self.changed:
                while not self.waiting and not self.closing:
                    self.changed.wait()
                if not self.waiting:
                    return
                step, folder = self.waiting.pop(0)
                self.in_flight = step
            try:
                self._upload(step, folder)
            finally:
                shutil.rmtree(folder, ignore_errors=True)
                with self.changed:
                    self.in_flight = None
                    self.changed.notify_all()

    def _upload(self, step: int, folder: Path) -> None:
        started = time.monotonic()
        try:
            # The run's description of this checkpoint names the best one, which rotation must keep.
            protect = protected_step(read_meta(folder))
            if not self.store.upload(folder, step, self.attempt, may_commit=self.may_commit,
                                     commit_within_s=self.commit_within_s):  # fmt: skip
                return
            self.uploaded.append(step)
            with self.changed:
                self.unannounced.append(step)
                self.stored.add(step)
            removed = self.store.rotate(self.keep, protect)
            with self.changed:
                self.stored.difference_update(removed)
        except Exception:  # the store is away or refused: the next checkpoint tries again
            log.exception("job %s: uploading checkpoint %d failed", self.store.job_id, step)
            return
        log.info("job %s: checkpoint %d in the store (%.1f s)%s", self.store.job_id, step,
                 time.monotonic() - started, f", rotated out {removed}" if removed else "")  # fmt: skip

    def finish(self, *, abort: bool = False, timeout_s: float | None = None) -> None:
        """The run has ended: upload its last checkpoint and wait for every pending upload.

        ``abort`` (the attempt was fenced out) drops what waits; an upload in flight then finds
        ``may_commit`` False and leaves no manifest.
        """
        if not abort:
            self._stage_newest(force=True)
        with self.changed:
            self.closing = True
            if abort:
                for _, folder in self.waiting:
                    shutil.rmtree(folder, ignore_errors=True)
                self.waiting = []
            self.changed.notify_all()
        if self.thread.is_alive():
            self.thread.join(timeout_s)
        if self.thread.is_alive():
            log.error("job %s: checkpoint upload still running after %.0f s; leaving it", self.store.job_id,
                      timeout_s or 0)  # fmt: skip
        shutil.rmtree(self.staging_dir, ignore_errors=True)


def fetch_newest(settings: Settings, job_id: str, output_dir: Path, trusted_step: int) -> int | None:
    """Make the newest usable checkpoint local: the store's (remote roots), when newer than any on this disk.

    Checkpoints past ``trusted_step`` (the job's stored progress) are deleted from the store, as
    from the disk: their steps have no metric points. One that fails its manifest check is skipped
    for the next older. Returns the step fetched, or None when the disk already had the newest.
    """
    if is_local_root(settings.artifacts_root):
        return None
    store = CheckpointStore(settings.artifacts_root, job_id)
    steps = store.steps()
    for step in (s for s in steps if s > trusted_step):
        log.info("job %s: stored checkpoint %d is past the trusted step %d: deleting it", store.job_id, step,
                 trusted_step)  # fmt: skip
        store.delete(step)
    local = newest_checkpoint(output_dir)
    local_step = int(local.name.rsplit("-", 1)[1]) if local is not None else -1
    for step in sorted((s for s in steps if local_step < s <= trusted_step), reverse=True):
        try:
            store.download(step, output_dir)
        except CheckpointError as exc:
            log.warning("job %s: not resuming from stored checkpoint %d: %s", store.job_id, step, exc)
            continue
        log.info("job %s: fetched checkpoint %d from the store", store.job_id, step)
        return step
    return None


def resume_phrase(settings: Settings, job_id: str, output_dir: Path) -> str:
    """Where the job's next attempt resumes, wherever it runs, for its status event: the store's newest
    complete checkpoint on a remote root, else this disk's."""
    if is_local_root(settings.artifacts_root):
        local = newest_checkpoint(output_dir)
        step = int(local.name.rsplit("-", 1)[1]) if local is not None else None
    else:
        try:
            step = max(CheckpointStore(settings.artifacts_root, job_id).steps(), default=None)
        except Exception:  # the store is away (or refuses): a message must not stop a requeue
            log.warning("job %s: listing stored checkpoints failed", job_id, exc_info=True)
            return "from its newest stored checkpoint, if any"
    return f"from {CHECKPOINT_PREFIX}{step}" if step is not None else "from the start (no checkpoint yet)"


def renew_to_commit(settings: Settings, job_id: str, attempt: int | None) -> bool:
    """Renew ``attempt``'s lease, right before its uploader commits a checkpoint; False (commit
    nothing) when the attempt was fenced out, or the database is away (unknown is no). Renewed, the job
    cannot move to another attempt for a whole lease: the commit's presigned PUT, valid for half of
    one (service_core/checkpoints.py), either lands before that or is refused by the store."""
    if attempt is None:
        return True
    try:
        with session_scope(settings.database_url) as session:
            return renew_lease(session, job_id, attempt, settings.lease_seconds)
    except DATABASE_UNAVAILABLE:
        return False


def store_checkpoint_events(settings: Settings, job_id: str, attempt: int | None, events: list[Event]) -> None:
    """Store ``checkpoint`` events of uploads committed after the run's own events were written (its
    last checkpoint); a fenced-out attempt or an absent database loses them, logged."""
    if not events:
        return
    rows = [(str(e["event"]), event_data(e), event_time(e)) for e in events]
    try:
        with session_scope(settings.database_url) as session:
            add_events(session, job_id, rows, attempt=attempt)
    except (FencedOut, *DATABASE_UNAVAILABLE):
        log.warning("job %s: %d checkpoint events not stored", job_id, len(events), exc_info=True)


def start_uploader(
    job_id: str, settings: Settings, paths: RunPaths, spec: dict[str, Any], attempt: int | None
) -> CheckpointUploader | None:
    """The run's checkpoint uploader, started; None on a local artifacts root (the run trains into it)."""
    if is_local_root(settings.artifacts_root):
        return None
    keep = (spec.get("training") or {}).get("save_total_limit")
    store = CheckpointStore(settings.artifacts_root, job_id)
    renew = lambda: renew_to_commit(settings, job_id, attempt)  # noqa: E731
    uploader = CheckpointUploader(store, paths.output_dir, paths.work_dir / "upload", attempt=attempt, keep=keep,
                                  may_commit=renew, commit_within_s=settings.lease_seconds / 2)  # fmt: skip
    return uploader.start()
