"""Holding a live job's run still, so that what a test does to it lands while it is mid-run.

The suite's jobs are tiny: on a quiet machine one trains its hundreds of steps in about a second, often
before a loss, a pause or a Ctrl-C that a test sends can reach it through the API, the database and
its slot. A test that must act mid-run freezes the run (SIGSTOP to its process group: its dataloader
workers or ranks too) at a point it chose, acts, and lets it go on (SIGCONT). Its slot is not held:
it goes on renewing the lease, uploading checkpoints and stopping the run as asked. A stopped process
keeps a SIGTERM pending until it goes on, and a slot writes the stop file before it signals
(worker/supervisor.py), so a run released once its stop file exists stops after the step it was in.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

RELEASE_AFTER_S = 120.0  # a test that fails meanwhile leaves nothing frozen for longer


def run_pid(work_dir: Path) -> int | None:
    """The leader pid of the run whose work dir is ``work_dir``, while it runs (its slot's pid file)."""
    try:
        return int((work_dir / "run.pid").read_text())
    except (OSError, ValueError):
        return None


def stop_asked(work_dir: Path) -> bool:
    """Whether the run's slot has asked it to stop (the stop file, written before the SIGTERM)."""
    return (work_dir / "STOP").exists()


def _signal_groups(pids: Iterable[int], sig: signal.Signals) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, sig)


@contextlib.contextmanager
def held(pids: Iterable[int]) -> Iterator[None]:
    """The runs led by ``pids`` frozen for the block."""
    pids = list(pids)
    _signal_groups(pids, signal.SIGSTOP)
    try:
        yield
    finally:
        _signal_groups(pids, signal.SIGCONT)


def hold_until_asked_to_stop(work_dir: Path) -> None:
    """Freeze the run of ``work_dir`` now, and let it go on once its slot asks it to stop (or after
    :data:`RELEASE_AFTER_S`): for a stop the test starts afterwards, by a call that does not return
    until the run has stopped (a Ctrl-C of ``trainjobs dev``)."""
    pid = run_pid(work_dir)
    assert pid is not None, f"no run in {work_dir}"
    _signal_groups([pid], signal.SIGSTOP)

    def release() -> None:
        deadline = time.monotonic() + RELEASE_AFTER_S
        while not stop_asked(work_dir) and time.monotonic() < deadline:
            time.sleep(0.01)
        _signal_groups([pid], signal.SIGCONT)

    threading.Thread(target=release, daemon=True, name="run-hold").start()
