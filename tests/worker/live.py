"""A live service for end-to-end tests: the API under uvicorn and a worker (``python -m worker.main``),
as real subprocesses, with a guarantee that none of their processes (slots, training runs) outlives
the test."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from service_core.db import Base
from service_core.db.session import get_engine, session_scope
from service_core.keys import create_api_key
from service_core.settings import Settings
from trainjobs.seaweedfs import free_port
from trainjobs.sse import iter_events
from worker.processes import ChildProcess, start_detached, stop_processes
from worker.procfs import processes_mentioning


def stop(proc: ChildProcess, timeout: float) -> None:
    """SIGTERM, then SIGKILL to its process group after ``timeout`` (as the worker stops its slots)."""
    stop_processes([proc], timeout, "test service process")


@dataclass
class LiveService:
    url: str
    api_key: str
    settings: Settings
    queue: str
    log_dir: Path
    workers: list[ChildProcess] = field(default_factory=list)

    @property
    def worker(self) -> ChildProcess:
        return self.workers[0]

    def client(self, **kwargs: Any) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {self.api_key}"}, **kwargs)


def service_env(settings: Settings) -> dict[str, str]:
    from worker.main import settings_env

    env = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_URL", "BROKER_URL", "ARTIFACTS_ROOT"))}
    env.update(settings_env(settings))
    env["PYTHONUNBUFFERED"] = "1"
    return env


def start_worker(service: LiveService) -> ChildProcess:
    """Start a worker (``python -m worker.main``) on the service's settings and queue; it is stopped
    with the service."""
    with (service.log_dir / "worker.log").open("ab") as log:
        argv = [sys.executable, "-m", "worker.main", "--queues", service.queue]
        proc = start_detached(argv, service_env(service.settings), log)
    service.workers.append(proc)
    return proc


@contextmanager
def live_service(settings: Settings, queue: str, log_dir: Path) -> Iterator[LiveService]:
    """Start the API and a worker consuming ``queue`` on ``settings``; stop both and sweep leftovers."""
    Base.metadata.create_all(get_engine(settings.database_url))
    with session_scope(settings.database_url) as session:
        api_key = create_api_key(session, "alice", settings=settings)
    get_engine(settings.database_url).dispose()
    env = service_env(settings)
    port = free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    api_log = (log_dir / "api.log").open("wb")
    api = start_detached(
        [sys.executable, "-m", "uvicorn", "--factory", "api.main:create_app", "--host", "127.0.0.1",
         "--port", str(port), "--log-level", "warning"], env, api_log,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    service = LiveService(url=url, api_key=api_key, settings=settings, queue=queue, log_dir=log_dir)
    try:
        start_worker(service)
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if api.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the API did not start:\n{(log_dir / 'api.log').read_text()[-3000:]}")
            time.sleep(0.2)
        yield service
    finally:
        for proc in service.workers:
            stop(proc, settings.cancel_grace_seconds + 40)
        stop(api, 15)
        api_log.close()
        # Slots and runs live in their own sessions: sweep anything still mentioning this service.
        for marker in (str(settings.home), queue):
            for pid in processes_mentioning(marker):
                os.kill(pid, signal.SIGKILL)


def read_sse(response: httpx.Response, limit: int | None = None) -> list[dict[str, Any]]:
    """SSE frames (``id`` / ``event`` / ``data``, parsed by httpx-sse) until the stream ends or ``limit`` frames."""
    frames: list[dict[str, Any]] = []
    for event in iter_events(response):
        frames.append({"id": event.seq, "event": event.event, "data": event.data})
        if limit is not None and len(frames) >= limit:
            break
    return frames
