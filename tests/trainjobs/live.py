"""A real service for client and CLI tests: migrations, API and worker as the processes production runs.

The commands are the ones ``docker-compose.yml`` runs (``test_compose.py`` checks that they match):
``trainjobs migrate``, ``trainjobs serve``, ``trainjobs worker``. The database is a SQLite file and
the broker the embedded one, all in a temporary home.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.worker.live import free_port, processes_mentioning
from trainjobs.client import Client
from worker.processes import ChildProcess, start_detached

REPO = Path(__file__).resolve().parents[2]

# argv after the program name, shared with the compose test: these are the commands the suite runs.
MIGRATE_ARGS = ["migrate"]
SERVE_ARGS = ["serve", "--host", "127.0.0.1", "--port", "{port}"]
WORKER_ARGS = ["worker", "--gpus", "0", "--queue", "default"]


def trainjobs_argv(args: list[str]) -> list[str]:
    """``trainjobs ARGS`` with this interpreter (what the console script runs)."""
    return [sys.executable, "-m", "trainjobs.cli", *args]


class LiveService:
    """The API and one worker on a temporary home; the API can be killed and restarted mid-job."""

    def __init__(self, home: Path, key: str = "tj_test-admin-key-for-the-live-service"):
        self.home = home
        self.key = key
        self.port = free_port()
        self.data_root = home / "data"
        self.env = {
            **os.environ,
            "TRAINJOBS_HOME": str(home),
            "TRAINJOBS_API_KEY": key,
            "TRAINJOBS_CANCEL_GRACE_SECONDS": "5",
            "TRAINJOBS_QUEUE_PRICES": '{"default": 1.5}',
            "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1",
        }
        for name in ("DATABASE_URL", "BROKER_URL", "ARTIFACTS_ROOT", "DATA_ROOT", "TRAINJOBS_ENV"):
            self.env.pop(name, None)
        self.api: ChildProcess | None = None
        self.worker: ChildProcess | None = None
        self.logs = home / "logs"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _popen(self, name: str, argv: list[str]) -> ChildProcess:
        self.logs.mkdir(parents=True, exist_ok=True)
        with (self.logs / f"{name}.log").open("ab") as log:
            return start_detached(argv, self.env, log, cwd=str(REPO))

    def migrate(self) -> None:
        subprocess.run(trainjobs_argv(MIGRATE_ARGS), env=self.env, cwd=REPO, check=True, capture_output=True)

    def start_api(self, timeout: float = 60.0) -> None:
        args = [a.format(port=self.port) for a in SERVE_ARGS]
        self.api = self._popen("api", trainjobs_argv(args))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.api.poll() is None, (self.logs / "api.log").read_text()
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"API did not answer on {self.url}")

    def kill_api(self) -> None:
        """A crash, not a shutdown: SIGKILL, so open streams are cut mid-flight."""
        assert self.api is not None
        os.killpg(self.api.pid, signal.SIGKILL)
        self.api.wait()
        self.api = None

    def start_worker(self) -> None:
        self.worker = self._popen("worker", trainjobs_argv(WORKER_ARGS))

    def start(self) -> LiveService:
        self.data_root.mkdir(parents=True, exist_ok=True)
        self.migrate()
        self.start_api()
        self.start_worker()
        return self

    def stop(self) -> None:
        for process in (self.worker, self.api):
            if process is not None and process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in (self.worker, self.api):
            if process is None:
                continue
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        # Training runs live in their own sessions: sweep any that still names this home.
        for pid in processes_mentioning(str(self.home)):
            os.kill(pid, signal.SIGKILL)

    def client(self) -> Client:
        return Client(self.url, self.key)

    def cli(self, *args: str, timeout: float = 180.0, key: str | None = None) -> subprocess.CompletedProcess[str]:
        """Run ``trainjobs ARGS`` against this service as a user would, capturing its output."""
        env = {**self.env, "TRAINJOBS_URL": self.url, "TRAINJOBS_API_KEY": key or self.key}
        return subprocess.run(trainjobs_argv(list(args)), env=env, cwd=self.home, capture_output=True, text=True,
                              timeout=timeout)  # fmt: skip

    def cli_popen(self, *args: str) -> subprocess.Popen[str]:
        env = {**self.env, "TRAINJOBS_URL": self.url, "TRAINJOBS_API_KEY": self.key}
        return subprocess.Popen(trainjobs_argv(list(args)), env=env, cwd=self.home, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip
