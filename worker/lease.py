"""A running job's heartbeat lease, kept by the slot that runs it, and what a fenced-out slot does.

The claim gives the attempt a lease of ``TRAINJOBS_LEASE_SECONDS``; :class:`LeaseKeeper` renews it
every ``TRAINJOBS_LEASE_RENEW_SECONDS`` from a thread of the slot process. A slot frozen (SIGSTOP, a
paused VM, a lost host) stops renewing, and the sweep (worker/sweeper.py) requeues its job once the
lease has run out. When the frozen slot wakes up, its renewal (or any other write) is refused by the
fencing token (service_core/db/jobstore.py:fence): it kills its run at once, without a checkpoint,
because the job and its output folder now belong to the newer attempt.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading

from sqlalchemy.exc import SQLAlchemyError

from service_core.db.jobstore import renew_lease
from service_core.db.session import session_scope
from service_core.settings import Settings
from worker.db_retry import retry_database
from worker.forkserver import fork_server_pid
from worker.gang import renew_node_lease
from worker.procfs import all_processes, cmdline
from worker.zygote import MARKER

log = logging.getLogger(__name__)


# On every run's command line: ``python -m trainer_core ...`` or, for a run forked by the slot's fork
# server, the server's own command line (worker/zygote.py).
RUN_MARKERS = (b"trainer_core", MARKER.encode())


def kill_own_runs() -> list[int]:
    """SIGKILL the process group of every run this process started (a child leading its own group,
    of this process or of its fork server).

    Not a SIGTERM: a run asked to stop would checkpoint into a folder the newer attempt now owns.
    """
    me = os.getpid()
    server = fork_server_pid()
    parents = {me} if server is None else {me, server}
    killed = []
    for proc in all_processes():
        if proc.ppid not in parents or proc.pgid != proc.pid or proc.pid == server:
            continue
        if any(marker in cmdline(proc.pid) for marker in RUN_MARKERS):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
                killed.append(proc.pid)
    return killed


def fenced_out(job_id: str, attempt: int, what: str) -> None:
    """A write of ``attempt`` was refused: log it and end this slot's run of the job."""
    killed = kill_own_runs()
    log.error("job %s: attempt %d is fenced out (%s refused); killed its run %s", job_id, attempt, what, killed)


class LeaseKeeper:
    """Renews one attempt's lease from a daemon thread until stopped, or until the attempt is fenced out."""

    def __init__(self, job_id: str, attempt: int, settings: Settings, *, slot: str | None = None) -> None:
        self.job_id, self.attempt, self.slot = job_id, attempt, slot
        self.url, self.lease_s = settings.database_url, settings.lease_seconds
        self.every_s = settings.lease_renew_seconds
        self.fenced = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"lease-{job_id}", daemon=True)

    def start(self) -> LeaseKeeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.every_s + 10)

    def confirm(self) -> None:
        """Once stopped, renew once more unless already fenced out, so that the attempt is known to be
        this slot's before its end is written (artifacts, outcome, requeue).

        A slot frozen past its lease may find, on waking up, its run already gone (the same host's sweep
        kills a lost run by its pid file: worker/recovery.py). It then ends the attempt at once, before
        its renewal thread has run again, and would store artifacts into a job a newer attempt owns.
        Not for a node of a gang: the node holding rank 0 may have written the job's end already.
        """
        if self.slot is None and not self.fenced.is_set():
            retry_database(self.renew, f"job {self.job_id}: last lease renewal")

    def renew(self) -> bool:
        """One renewal; False (and the run killed) when the attempt is fenced out. A node of a multi-node
        job (``slot``) renews its own lease, and the job's becomes its nodes' earliest (worker/gang.py)."""
        with session_scope(self.url) as session:
            if self.slot is None:
                renewed = renew_lease(session, self.job_id, self.attempt, self.lease_s)
            else:
                renewed = renew_node_lease(session, self.job_id, self.attempt, self.slot, self.lease_s)
        if not renewed:
            self.fenced.set()
            fenced_out(self.job_id, self.attempt, "lease renewal")
        return renewed

    def _loop(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                if not self.renew():
                    return
            except SQLAlchemyError as exc:  # a database blip: the lease has slack, try again next time
                log.warning("job %s: renewing the lease failed (%s); retrying", self.job_id, exc)
