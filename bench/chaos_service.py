"""The service the chaos bench breaks: API and workers as real processes, in one of two shapes.

``embedded``: SQLite file and the embedded (SQLite) broker under a temporary home.
``production``: a fresh PostgreSQL database reached through a TCP proxy the bench can cut, and a
``redis-server --appendonly yes`` of its own on a free port, which the bench can kill and restart.

The bench itself reads the database directly (not through the proxy): it observes, it is not a client
that an outage should stop.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psycopg

from bench.bench_api import TINY_BERT, free_port, service_env, write_csv
from bench.chaos_proxy import TcpProxy
from service_core.db import Base
from service_core.db.session import get_engine
from service_core.settings import Settings
from worker.processes import ChildProcess, start_detached, stop_processes
from worker.procfs import all_processes, environ, processes_mentioning

REPO = Path(__file__).resolve().parents[1]
PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
REDIS_SERVER = "/usr/bin/redis-server"
API_KEY = "tj_chaos-bench-admin-key-0123456789"
GRACE_S = 5.0
LIVE: list[Service] = []  # every service not yet closed, for a Ctrl-C to close from the main thread


def wait_for(condition: Callable[[], Any], timeout: float, what: str, every: float = 0.2) -> Any:
    """Poll ``condition`` until it returns something truthy; TimeoutError naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(every)


def processes_of(home: Path) -> list[int]:
    """Live processes whose environment names ``home`` as TRAINJOBS_HOME: API, workers, slots, runs."""
    found = []
    for proc in all_processes():
        if proc.pid != os.getpid() and proc.alive and environ(proc.pid).get("TRAINJOBS_HOME") == str(home):
            found.append(proc.pid)
    return found


class RedisServer:
    """A ``redis-server --appendonly yes`` of the bench's own, restartable on the same port and files."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.port = folder, free_port()
        folder.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        argv = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder),
                "--appendonly", "yes", "--appendfsync", "everysec", "--save", "", "--daemonize", "no"]  # fmt: skip
        log = (self.folder / "redis.log").open("ab")
        self.proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        import redis

        wait_for(lambda: _redis_ping(redis.Redis(port=self.port)), 20, "redis-server to start")

    def kill(self) -> None:
        """SIGKILL, not a shutdown: what the AOF (fsynced every second) keeps is what survives."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


def _redis_ping(client: Any) -> bool:
    try:
        return bool(client.ping())
    except Exception:  # any connection error means "not yet"
        return False


class Service:
    """API + workers of one shape; every process, database and file removed by :meth:`close`."""

    def __init__(self, shape: str, extra_env: dict[str, str] | None = None) -> None:
        self.shape = shape
        LIVE.append(self)
        self.tag = uuid.uuid4().hex[:8]
        self.home = Path(tempfile.mkdtemp(prefix=f"trainjobs-chaos-{shape}-{self.tag}-"))
        (self.home / "logs").mkdir()
        self.db_name: str | None = None
        self.proxy: TcpProxy | None = None
        self.redis: RedisServer | None = None
        self.api: ChildProcess | None = None
        self.workers: list[ChildProcess] = []
        self.port = free_port()
        self.last_body = ""  # of the last answer to `answers`, for a report of an unexpected one
        self.queue = f"chaos-{self.tag}"
        env = {"TRAINJOBS_HOME": str(self.home), "TRAINJOBS_CANCEL_GRACE_SECONDS": str(GRACE_S), **(extra_env or {})}
        for aid in ("TRAINJOBS_ZYGOTE_PARENT", "TRAINJOBS_SERVICE_PARENT"):  # run by the suite: its parents fork
            if parent := os.environ.get(aid):  # slots' zygotes, and API processes, workers and slots
                env[aid] = parent
        observer: str | None = None
        if shape == "production":
            self.db_name = f"trainjobs_chaos_{self.tag}"
            with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
                conn.execute(f'CREATE DATABASE "{self.db_name}"')
            self.proxy = TcpProxy(("127.0.0.1", 5432))
            self.proxy.restore()
            self.redis = RedisServer(self.home / "redis")
            self.redis.start()
            observer = f"postgresql+psycopg://postgres@127.0.0.1:5432/{self.db_name}"
            env["DATABASE_URL"] = f"postgresql+psycopg://postgres@127.0.0.1:{self.proxy.port}/{self.db_name}"
            env["BROKER_URL"] = f"redis://127.0.0.1:{self.redis.port}/0"
        self.env_settings = env
        self.settings = Settings.model_validate(env)
        self.observer_url = observer or self.settings.database_url
        Base.metadata.create_all(get_engine(self.observer_url))
        # One thread per run: the tiny runs share two cores, where torch's thread pools only fight.
        self.env = service_env({**env, "TRAINJOBS_API_KEY": API_KEY}) | {"OMP_NUM_THREADS": "1"}
        self.data_files = write_csv(self.settings.data_root / "chaos", rows=64)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _spawn(self, name: str, argv: list[str]) -> ChildProcess:
        """``argv`` in a session of its own: forked ready-imported where the suite's service parent runs
        this (worker/service_parent.py), else a new interpreter."""
        with (self.home / "logs" / f"{name}.log").open("ab") as log:
            return start_detached(argv, self.env, log, cwd=str(REPO))

    def start_api(self) -> None:
        """``trainjobs serve`` (the production command), waited for until it answers."""
        self.api = self._spawn("api", [sys.executable, "-m", "trainjobs.cli", "serve", "--host", "127.0.0.1",
                                       "--port", str(self.port), "--no-access-log"])  # fmt: skip
        api = self.api
        # Until it has warmed up too: a submit before that waits for the warm-up (a 503 after a minute).
        wait_for(lambda: self.warmed_up() or api.poll() is not None, 300, "the API to start", 0.3)
        if api.poll() is not None:
            raise RuntimeError(f"the API exited:\n{self.log_tail('api')}")

    def warmed_up(self) -> bool:
        """Whether ``/readyz`` answers 200 with ``warmed_up`` (the estimator and preflight imported)."""
        try:
            answer = httpx.get(f"{self.url}/readyz", timeout=10)
            return answer.status_code == 200 and bool(answer.json().get("warmed_up"))
        except (httpx.TransportError, ValueError):
            return False

    def kill_api(self) -> None:
        if self.api is not None:
            os.killpg(self.api.pid, signal.SIGKILL)
            self.api.wait()
            self.api = None

    def start_worker(self, queues: str | None = None, wait: bool = True) -> ChildProcess:
        """``python -m worker.main``; with ``wait``, until its slot logged that it is ready."""
        log = self.home / "logs" / f"worker{len(self.workers)}.log"
        proc = self._spawn(log.stem, [sys.executable, "-m", "worker.main", "--queues", queues or self.queue])
        self.workers.append(proc)
        if wait:
            wait_for(lambda: " ready." in log.read_text(errors="replace") or proc.poll() is not None, 600,
                     "a worker slot to be ready", 0.3)  # fmt: skip
            if proc.poll() is not None:
                raise RuntimeError(f"a worker exited:\n{self.log_tail(log.stem)}")
        return proc

    def wait_workers_ready(self) -> None:
        """Until every live worker's slot logged that it is ready."""
        for i, proc in enumerate(self.workers):
            log = self.home / "logs" / f"worker{i}.log"
            if proc.poll() is None:
                wait_for(lambda: " ready." in log.read_text(errors="replace") or proc.poll() is not None, 600,  # noqa: B023
                         "a worker slot to be ready", 0.3)  # fmt: skip

    def live_workers(self) -> list[ChildProcess]:
        return [w for w in self.workers if w.poll() is None]

    def answers(self, path: str) -> int:
        """The status code of ``GET path`` (0 when nothing answers)."""
        try:
            headers = {"Authorization": f"Bearer {API_KEY}"}
            answer = httpx.get(f"{self.url}{path}", headers=headers, timeout=10)
            self.last_body = answer.text[:300]
            return answer.status_code
        except httpx.TransportError:
            return 0

    def submit(self, name: str, training: dict[str, Any], queue: str | None = None, **extra: Any) -> str:
        """POST one tiny config-built BERT run; returns the job id."""
        spec = {
            "name": name, "task": "text-classification", "model": {"config": dict(TINY_BERT)},
            "dataset": {"path": "csv", "data_files": self.data_files, "text_column": "text", "label_column": "label"},
            "preprocessing": {"max_length": 32},
            "training": {"per_device_train_batch_size": 8, "logging_steps": 1, "eval_strategy": "no", "seed": 0,
                         "save_steps": 10_000, **training},
            "queue": queue or self.queue, **extra,
        }  # fmt: skip
        answer = httpx.post(f"{self.url}/v1/jobs", json=spec, headers={"Authorization": f"Bearer {API_KEY}"},
                            timeout=120)  # fmt: skip
        if answer.status_code != 201:
            raise RuntimeError(f"submit {name}: {answer.status_code} {answer.text[:500]}")
        return str(answer.json()["id"])

    def cancel(self, job_id: str) -> int:
        answer = httpx.post(f"{self.url}/v1/jobs/{job_id}/cancel", headers={"Authorization": f"Bearer {API_KEY}"},
                            timeout=30)  # fmt: skip
        return answer.status_code

    def log_tail(self, name: str, chars: int = 3000) -> str:
        path = self.home / "logs" / f"{name}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def close(self) -> None:
        """Stop workers (warm), the API, Redis; sweep leftovers; drop the database; remove the home."""
        if self not in LIVE:
            return
        LIVE.remove(self)
        stop_processes(self.live_workers(), GRACE_S + 30, "chaos worker")
        if self.api is not None:
            stop_processes([self.api], 15, "chaos API")
        for pid in {*processes_of(self.home), *processes_mentioning(self.queue)}:
            os.kill(pid, signal.SIGKILL)
        if self.redis is not None:
            self.redis.kill()
        get_engine(self.observer_url).dispose()
        if self.proxy is not None:
            self.proxy.cut()
        if self.db_name is not None:
            with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE IF EXISTS "{self.db_name}" WITH (FORCE)')
        shutil.rmtree(self.home, ignore_errors=True)
