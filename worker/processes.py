"""Stopping the processes a supervisor started: SIGTERM to all at once, SIGKILL to what outlives the timeout.

Used by the worker for its slots and by ``trainjobs serve --workers N`` for its API processes; both
start each child in a session of its own, so the SIGKILL goes to the child's whole process group.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Sequence

log = logging.getLogger(__name__)


def stop_processes(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float, what: str) -> None:
    """SIGTERM every process in ``procs``, wait up to ``timeout_s`` in all, then kill the rest's groups."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s %d did not stop in %.0fs: killing it", what, proc.pid, timeout_s)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
