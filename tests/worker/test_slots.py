"""`--gpus 0,1` starts one worker slot per GPU, each seeing only its own device; slots get the
worker's settings through their environment and stop on request."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from worker.main import start_slots, stop_slots
from worker.procfs import environ, status_field

from .conftest import make_settings


def catches_sigterm(pid: int) -> bool:
    """Whether the process has a handler for SIGTERM (the SigCgt mask in /proc/PID/status)."""
    mask = status_field(pid, "SigCgt")
    return mask is not None and bool(int(mask, 16) >> (signal.SIGTERM - 1) & 1)


def test_one_slot_per_gpu_with_its_device(tmp_path: Path) -> None:
    settings = make_settings(tmp_path, ARTIFACTS_ROOT=str(tmp_path / "store"))
    procs = start_slots(["slot-test"], ["0", "1"], settings)
    try:
        assert len(procs) == 2
        envs = [environ(p.pid) for p in procs]
        assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["0", "1"]
        assert all(e["TRAINJOBS_HOME"] == str(tmp_path) for e in envs)
        assert all(e["ARTIFACTS_ROOT"] == str(tmp_path / "store") for e in envs)
        assert all("DATABASE_URL" not in e for e in envs)  # unset in the settings: the default applies
        deadline = time.monotonic() + 60
        while not (tmp_path / "broker.db").exists():  # the slots connected to the embedded broker
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.2)
        # ... and finished starting: Celery's SIGTERM handler (a warm shutdown) is installed. A fixed
        # sleep here lost the race on a loaded machine.
        while not all(catches_sigterm(p.pid) for p in procs):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.2)
        assert all(p.poll() is None for p in procs)  # both slots are up and serving
    finally:
        stop_slots(procs, timeout_s=30)
    assert [p.returncode for p in procs] == [0, 0]  # a warm shutdown, not a kill


def test_queues_are_declared_once_before_the_slots_start(tmp_path: Path) -> None:
    """Two slots starting on a fresh embedded broker used to race to INSERT the queue's row, and the
    loser died on the UNIQUE constraint; the queues now exist before any slot starts."""
    import sqlite3

    from worker.celery_app import declare_queues

    settings = make_settings(tmp_path)
    declare_queues(["q-a", "q-b"], settings)
    declare_queues(["q-a"], settings)  # idempotent: a restart declares them again
    with sqlite3.connect(tmp_path / "broker.db") as conn:
        names = sorted(row[0] for row in conn.execute("SELECT name FROM kombu_queue"))
    assert names == ["q-a", "q-b"]
