"""Children die with their parent: a killed or hung-up launcher, or a killed worker, leaves nothing
running, listening or consuming; and one ``trainjobs dev`` per home (issue 12, "Lifecycle")."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.trainjobs.live import free_port, trainjobs_argv
from tests.trainjobs.test_dev_launcher import start_dev
from tests.trainjobs.test_readme_fresh_clone import processes_in
from tests.worker.live import processes_mentioning

pytestmark = pytest.mark.slow


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.3)
    return condition()


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_killed_launcher_leaves_nothing_and_its_stale_lock_is_taken_over(tmp_path: Path) -> None:
    home, port = tmp_path / "var", free_port()
    dev = start_dev(home, port)
    try:
        # A second launcher on the same home refuses, saying where the first one runs.
        second = subprocess.run(
            trainjobs_argv(["dev", "--port", str(free_port())]), cwd=tmp_path, capture_output=True, text=True,
            env={**os.environ, "TRAINJOBS_HOME": str(home)}, timeout=60, check=False,
        )  # fmt: skip
        assert second.returncode == 1
        assert "already running" in second.stderr and f"127.0.0.1:{port}" in second.stderr
        assert f"pid {dev.pid}" in second.stderr
        assert listening(port)
    finally:
        dev.send_signal(signal.SIGKILL)  # only the launcher, not its children's sessions
        dev.wait()
    assert wait_until(lambda: processes_in(tmp_path) == [], 60), processes_in(tmp_path)
    assert not listening(port)

    # The dead launcher's lock file is still there; the next start takes it over.
    assert (home / "dev.lock").is_file()
    dev = start_dev(home, port)
    dev.send_signal(signal.SIGHUP)  # its terminal closed: stops like Ctrl-C
    assert dev.wait(timeout=120) == 0
    assert wait_until(lambda: processes_in(tmp_path) == [], 30), processes_in(tmp_path)
    assert not listening(port)


def test_killed_worker_takes_its_slots_with_it(tmp_path: Path) -> None:
    home = tmp_path / "var"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_URL", "BROKER_URL"))}
    env["TRAINJOBS_HOME"] = str(home)
    queue = f"lifecycle-{os.getpid()}"
    from trainjobs.launcher import apply_migrations

    apply_migrations(f"sqlite:///{home}/trainjobs.db")
    worker = subprocess.Popen(trainjobs_argv(["worker", "--queue", queue]), env=env, cwd=tmp_path,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        # The slot is a `celery ... worker` process naming the queue on its command line.
        assert wait_until(lambda: any(p != worker.pid for p in processes_mentioning(queue)), 60)
    finally:
        worker.send_signal(signal.SIGKILL)
        worker.wait()
    assert wait_until(lambda: processes_mentioning(queue) == [], 60), processes_mentioning(queue)
