"""Supervise one run: start the job's training in its own process group and watch it until it ends.

The run is the ``trainer_core`` CLI (``python -m trainer_core SPEC --jsonl``; it starts torchrun itself
when the spec asks for several processes), forked from the slot's pre-imported parent when it has one
(worker/forkserver.py). Its stdout carries one JSON event per line, read as they
come and handed to :class:`worker.ingest.EventIngestor`; its stderr goes to the run's log
(``worker.log``).

Stopping (a user's cancel or the slot shutting down) asks the run to stop the way it understands:
the stop file and SIGTERM, after which it finishes the step, checkpoints and reports ``done`` /
``cancelled``. A run that has not exited after the grace period gets SIGKILL for its whole process
group, and the group is always swept when the run ends, so no training process outlives its job.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import IO, Any

from sqlalchemy import select

from service_core.db.models import Job
from service_core.db.session import DATABASE_UNAVAILABLE
from service_core.status import ErrorReason
from trainer_core.events import Event, parse_event_line
from trainer_core.launch import Rendezvous
from worker.db_retry import Backoff, retry_database
from worker.forkserver import RunProcess, start_run
from worker.ingest import EventIngestor, SessionFactory
from worker.outcome import RunOutcome, classify_exit, stderr_tail
from worker.paths import RunPaths
from worker.run_env import run_environment, spec_trackers

log = logging.getLogger(__name__)

CANCEL_POLL_S = 0.5


def train_args(paths: RunPaths, *, resume: bool, rendezvous: Rendezvous | None = None) -> list[str]:
    """The arguments of a run's ``python -m trainer_core`` (worker/forkserver.py:start_run starts it);
    ``rendezvous``: this node's of a multi-node job (worker/gang.py)."""
    args = [
        str(paths.spec_file), "--output-dir", str(paths.output_dir), "--jsonl",
        "--cache-dir", str(paths.cache_dir), "--stop-file", str(paths.stop_file),
    ]  # fmt: skip
    if resume:
        args.append("--resume")
    if paths.reach is not None:
        args += paths.reach.args()
    if rendezvous is not None:
        args += rendezvous.cli_args()
    return args


def _read_lines(stream: IO[str], out: queue.Queue[str | None]) -> None:
    for line in stream:
        out.put(line)
    out.put(None)


def kill_group(pgid: int, sig: signal.Signals = signal.SIGKILL) -> None:
    """Signal a whole process group; a group already gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def supervise_run(
    job_id: str,
    paths: RunPaths,
    session_factory: SessionFactory,
    *,
    resume: bool = False,
    grace_s: float = 30.0,
    should_stop: Callable[[], bool] = lambda: False,
    estimate: dict[str, Any] | None = None,
    attempt: int | None = None,
    watch: Callable[[], list[Event]] | None = None,
    on_checkpoint: Callable[[Event], None] | None = None,
    rendezvous: Rendezvous | None = None,
    extra_env: dict[str, str] | None = None,
) -> RunOutcome:
    """Start the run, stream its events into the database, stop it when asked; returns how it ended.

    ``attempt`` is the claim's fencing token: writes of a stale attempt raise ``FencedOut``. ``watch``
    is called on every turn of the loop while the run lives (the checkpoint uploader's poll); the
    events it returns are stored with the run's. ``on_checkpoint`` takes the run's ``checkpoint``
    events instead of the database (the uploader stores each once its checkpoint is in the store).
    ``rendezvous`` and ``extra_env``: a node of a multi-node job's (worker/gang.py).
    """
    run_watch = RunWatch(job_id, paths, session_factory, grace_s=grace_s, should_stop=should_stop, attempt=attempt,
                         watch=watch, on_checkpoint=on_checkpoint, rendezvous=rendezvous,
                         extra_env=extra_env)  # fmt: skip
    returncode = run_watch.start_and_watch(resume=resume)
    tail = stderr_tail(paths.log_file, run_watch.log_start)
    return classify_exit(run_watch.done, returncode, run_watch.stopped_by, tail, estimate)


class RunWatch:
    """One run's life: start it, pump its events, poll for a stop, sweep its process group."""

    def __init__(
        self,
        job_id: str,
        paths: RunPaths,
        session_factory: SessionFactory,
        *,
        grace_s: float,
        should_stop: Callable[[], bool],
        attempt: int | None = None,
        watch: Callable[[], list[Event]] | None = None,
        on_checkpoint: Callable[[Event], None] | None = None,
        rendezvous: Rendezvous | None = None,
        extra_env: dict[str, str] | None = None,
    ) -> None:
        self.job_id, self.paths, self.session_factory = job_id, paths, session_factory
        self.rendezvous, self.extra_env = rendezvous, extra_env or {}
        self.watch, self.on_checkpoint = watch, on_checkpoint
        self.grace_s, self.should_stop, self.attempt = grace_s, should_stop, attempt
        self.ingestor = EventIngestor(job_id, session_factory, attempt=attempt)
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.done: Event | None = None
        self.stopped_by: ErrorReason | None = None
        self.kill_at: float | None = None
        self.log_start = 0
        self.chatter: deque[str] = deque(maxlen=2000)  # stray stdout lines, kept for the log
        self.database = Backoff(f"job {job_id}")
        self.next_poll = 0.0

    def start(self, resume: bool) -> RunProcess:
        paths = self.paths
        paths.work_dir.mkdir(parents=True, exist_ok=True)
        paths.output_dir.mkdir(parents=True, exist_ok=True)
        paths.stop_file.unlink(missing_ok=True)
        with paths.log_file.open("ab") as log_handle:
            self.log_start = log_handle.tell()
            # No service secrets in a run's environment, a tracker's key only for its runs (worker/run_env.py).
            env = {**run_environment(os.environ, spec_trackers(paths.spec_file)), **self.extra_env}
            proc = start_run(train_args(paths, resume=resume, rendezvous=self.rendezvous), env, log_handle)
        paths.pid_file.write_text(str(proc.pid), encoding="utf-8")
        assert proc.stdout is not None
        threading.Thread(target=_read_lines, args=(proc.stdout, self.lines), daemon=True).start()
        return proc

    def start_and_watch(self, resume: bool) -> int:
        """Start the run and watch it to its end; returns its exit status (negative: killed by that signal)."""
        proc = self.start(resume)
        self.next_poll = time.monotonic()
        try:
            while True:
                try:
                    line = self.lines.get(timeout=0.05)
                except queue.Empty:
                    line = ""
                    if proc.poll() is not None:
                        # The run is gone but its stdout is still open: a leftover child holds it.
                        kill_group(proc.pid)
                if line is None:
                    break
                self.handle_line(line)
                if self.watch is not None:
                    for event in self.watch():
                        self.ingestor.add(event)
                now = time.monotonic()
                if self.database.ready(now):
                    self.database_work(proc, now)
                if self.kill_at is not None and now >= self.kill_at and proc.poll() is None:
                    log.warning("job %s: run alive %.0fs after SIGTERM, killing its group", self.job_id, self.grace_s)
                    kill_group(proc.pid)
                    self.kill_at = None
            return proc.wait()
        finally:
            self.finish(proc)

    def handle_line(self, line: str) -> None:
        if line:
            event = parse_event_line(line)
            if event is None:
                self.chatter.append(line)
            elif event["event"] == "done":
                self.done = event
            elif event["event"] == "checkpoint" and self.on_checkpoint is not None:
                self.on_checkpoint(event)
            else:
                self.ingestor.add(event)

    def database_work(self, proc: RunProcess, now: float) -> None:
        """Write due events and look for a stop; a database outage only delays these.

        The job's liveness is its lease, renewed by the slot's :class:`worker.lease.LeaseKeeper`, not
        anything written here.

        The run keeps training meanwhile and its events wait in the ingestor: an outage of a minute
        costs nothing but delay (retried with backoff, :mod:`worker.db_retry`).
        """
        try:
            if self.ingestor.due():
                self.ingestor.flush()
            if self.stopped_by is None and now >= self.next_poll:
                self.next_poll = now + CANCEL_POLL_S
                self.check_stop(proc, now)
        except DATABASE_UNAVAILABLE as exc:
            self.database.failed(now, exc)
            if self.stopped_by is None and self.should_stop():
                self.stop(proc, now, ErrorReason.shutdown_requeue)  # a shutdown needs no database
            return
        self.database.succeeded(now)

    def check_stop(self, proc: RunProcess, now: float) -> None:
        """A user's cancel or pause, or the slot's shutdown: ask the run to checkpoint and stop."""
        reason = _stop_reason(self.session_factory, self.job_id, self.should_stop)
        if reason is not None:
            self.stop(proc, now, reason)

    def stop(self, proc: RunProcess, now: float, reason: ErrorReason) -> None:
        self.stopped_by = reason
        log.info("job %s: stopping its run (%s)", self.job_id, reason)
        self.paths.stop_file.touch()
        _signal(proc, signal.SIGTERM)
        self.kill_at = now + self.grace_s

    def finish(self, proc: RunProcess) -> None:
        if proc.poll() is None:  # we are leaving on an error: do not leave the run behind
            _signal(proc, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=self.grace_s)
        # Sweep the group: dataloader workers or torchrun ranks must not outlive the run.
        kill_group(proc.pid)
        proc.wait()
        try:
            retry_database(lambda: self.ingestor.flush(final=True), f"job {self.job_id}: final events")
        except DATABASE_UNAVAILABLE:
            log.error("job %s: the database stayed away; %d events not stored", self.job_id,
                      len(self.ingestor.pending))  # fmt: skip
        if self.chatter:
            with self.paths.log_file.open("a", encoding="utf-8") as handle:
                handle.writelines(self.chatter)
        self.paths.pid_file.unlink(missing_ok=True)


def _signal(proc: RunProcess, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)


def user_stop(session_factory: SessionFactory, job_id: str) -> ErrorReason | None:
    """A user's cancel (it wins over a pause) or pause of the job, if one is asked."""
    with session_factory() as session:
        asked = session.execute(select(Job.cancel_requested, Job.pause_requested).where(Job.id == job_id)).first()
    if asked is not None and asked.cancel_requested:
        return ErrorReason.cancelled
    if asked is not None and asked.pause_requested:
        return ErrorReason.paused
    return None


def _stop_reason(session_factory: SessionFactory, job_id: str, should_stop: Callable[[], bool]) -> ErrorReason | None:
    """Why we are stopping the run, if we are: a user's cancel or pause, or the slot shutting down."""
    reason = user_stop(session_factory, job_id)
    if reason is None and should_stop():
        return ErrorReason.shutdown_requeue
    return reason
