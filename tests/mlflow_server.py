"""A real ``mlflow server`` for the tests: SQLite backend store, served artifacts, a free port.

Started once per test run (it takes seconds): tests/conftest.py's ``mlflow_tracking``, through
tests/shared_servers.py. Each test uses an experiment of its own. Its job runner (huey consumers, for
MLflow's GenAI jobs) stays off: nothing here uses it, and it would start seven processes on a two-core
machine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from trainjobs.seaweedfs import free_port

START_TIMEOUT_S = 90.0


@dataclass(frozen=True)
class MlflowServer:
    url: str  # http://127.0.0.1:<port>, the tracking URI
    root: Path  # its database and artifacts


def start_mlflow_server(root: Path) -> tuple[MlflowServer, int]:
    """Start ``mlflow server`` on 127.0.0.1 and wait until it answers; the server and the process group
    to stop it by (the server and the uvicorn it starts)."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    command = [
        sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}", "--artifacts-destination", str(root / "artifacts"),
    ]  # fmt: skip
    with (root / "server.log").open("wb") as log:
        proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _healthy(url):
        if proc.poll() is not None or time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            raise RuntimeError(f"mlflow server did not start:\n{(root / 'server.log').read_text()[-3000:]}")
        time.sleep(0.25)
    return MlflowServer(url=url, root=root), proc.pid


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2).status_code == 200
    except httpx.TransportError:
        return False
