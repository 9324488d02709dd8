"""A fleet in production shape on one machine: an API host and two worker hosts (tests/fleet/netns.py),
sharing only PostgreSQL, Redis and a SeaweedFS object store, each reached through the bridge address.

PostgreSQL and Redis are the machine's own servers on 127.0.0.1; a TCP forwarder on the bridge
address (bench/chaos_proxy.py) is how the hosts reach them, as a fleet reaches a database server.
SeaweedFS listens on the bridge itself. Leases are short, so a lost host's job moves within seconds.
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis
from sqlalchemy import select

from bench.chaos_proxy import TcpProxy
from service_core.db import Base, Job, JobEvent
from service_core.db.session import get_engine, session_scope
from service_core.keys import create_api_key
from service_core.runs import run_work_dir
from service_core.settings import Settings
from service_core.status import TERMINAL_STATUSES
from tests.run_holds import held, run_pid, stop_asked
from tests.worker.conftest import create_pg_database, drop_pg_database, make_settings, quick_spec
from tests.worker.live import service_env
from tests.worker.test_lease_live import wait_for
from trainjobs.seaweedfs import SeaweedFS

from .netns import Host, Network

REDIS_DB = 10  # the fleet's own Redis database; queue names are unique per test as well
API_PORT = 8000  # the API host has its own ports: no clash with anything of the machine's
# Seconds: a lease of 4 renewed twice a second, a sweep every second, lost messages re-sent after 2.
SHORT_LEASES = {"TRAINJOBS_LEASE_SECONDS": "4", "TRAINJOBS_LEASE_RENEW_SECONDS": "0.5",
                "TRAINJOBS_SWEEP_SECONDS": "1", "TRAINJOBS_REDELIVER_AFTER_SECONDS": "2"}  # fmt: skip
TERMINAL = frozenset(status.value for status in TERMINAL_STATUSES)


@dataclass
class Fleet:
    """The running fleet: hosts, the shared servers' addresses, and the test's own view of the database."""

    root: Path
    network: Network
    store: SeaweedFS
    env: dict[str, str]  # the deployment's variables, the same on every host (TRAINJOBS_HOME aside)
    database_url: str  # the same database through 127.0.0.1: the test process's reads
    api_key: str = ""

    @property
    def api(self) -> Host:
        return self.network.hosts["api"]

    @property
    def worker_hosts(self) -> list[Host]:
        return [host for name, host in self.network.hosts.items() if name != "api"]

    @property
    def url(self) -> str:
        return f"http://{self.api.address}:{API_PORT}"

    def settings(self, host: Host) -> Settings:
        """The settings of ``host``'s processes: the deployment's, with its own disk as home."""
        return make_settings(host.disk / "home", **self.env)

    def host_env(self, host: Host) -> dict[str, str]:
        """A host process's whole environment: the settings, the store's AWS variables, nothing local."""
        env = {k: v for k, v in service_env(self.settings(host)).items() if not k.startswith("AWS_")}
        return {**env, **self.store.aws_env()}

    def log(self, host: Host, program: str) -> Path:
        """Where ``program``'s output on ``host`` goes: outside its disk, which a lost host loses."""
        path = self.root / "logs" / f"{host.name}-{program}.log"
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def start_workers(self, hosts: list[Host], queue: str) -> None:
        """``python -m worker.main --queues queue`` on each of ``hosts`` (started side by side); returns
        once every slot consumes the queue."""
        for host in hosts:
            host.spawn([sys.executable, "-m", "worker.main", "--queues", queue], self.host_env(host),
                       self.log(host, f"worker-{queue}"))  # fmt: skip
        # Celery's own word that a slot consumes (the heartbeat row comes earlier, before the slot).
        ready = {host.name: self.log(host, f"worker-{queue}") for host in hosts}
        wait_for("the workers", lambda: all(f"@{name} ready." in log.read_text() for name, log in ready.items()),
                 timeout=180)  # fmt: skip

    def client(self, **kwargs: Any) -> httpx.Client:
        """An HTTP client of the API host, as a user's machine has (no proxy from the environment)."""
        headers = {"Authorization": f"Bearer {self.api_key}"}
        return httpx.Client(base_url=self.url, headers=headers, trust_env=False, timeout=60, **kwargs)

    def store_fs(self) -> Any:
        """The object store as the test sees it (its own s3fs instance: the suite's store may be another)."""
        import fsspec

        options = {"endpoint_url": self.store.endpoint}
        return fsspec.filesystem("s3", key=self.store.access_key, secret=self.store.secret_key,
                                 client_kwargs=options, skip_instance_cache=True)  # fmt: skip

    def stored_checkpoints(self, job_id: str) -> list[int]:
        """Steps of the job's complete checkpoints in the store (those whose manifest is written)."""
        return [int(path.split("/")[-2]) for path in self._manifest_paths(job_id)]

    def _manifest_paths(self, job_id: str) -> list[str]:
        from service_core.checkpoints import CHECKPOINTS_DIR, MANIFEST

        base = f"{self.env['ARTIFACTS_ROOT'].removeprefix('s3://')}/{job_id}/{CHECKPOINTS_DIR}"
        return sorted(self.store_fs().glob(f"{base}/*/{MANIFEST}"), key=lambda path: int(path.split("/")[-2]))

    def job(self, job_id: str) -> Job:
        with session_scope(self.database_url) as session:
            return session.execute(select(Job).where(Job.id == job_id)).scalar_one()

    def host_running(self, job_id: str) -> Host | None:
        """The worker host whose name the running job carries."""
        job = self.job(job_id)
        if job.status != "running":
            return None
        return next((h for h in self.worker_hosts if job.worker == h.name), None)

    def events(self, job_id: str) -> list[tuple[str, dict[str, Any]]]:
        """The job's events (kind, data) in ``seq`` order."""
        with session_scope(self.database_url) as session:
            query = select(JobEvent.kind, JobEvent.data).where(JobEvent.job_id == job_id).order_by(JobEvent.seq)
            return [(kind, dict(data)) for kind, data in session.execute(query)]

    def statuses(self, job_id: str) -> list[dict[str, Any]]:
        """The data of the job's status events, in order."""
        return [data for kind, data in self.events(job_id) if kind == "status"]

    def manifests(self, job_id: str) -> list[dict[str, Any]]:
        """The manifests of the job's complete checkpoints in the store, oldest step first."""
        fs = self.store_fs()
        return [json.loads(fs.cat_file(path)) for path in self._manifest_paths(job_id)]

    def run_pids(self, job_id: str) -> dict[str, int]:
        """The leader pid of the job's run on each worker host that has one now, by host name."""
        pids = {host.name: run_pid(run_work_dir(self.settings(host).home, job_id)) for host in self.worker_hosts}
        return {name: pid for name, pid in pids.items() if pid is not None}

    def stop_asked(self, job_id: str) -> bool:
        """Whether a slot has asked the job's run to stop."""
        return any(stop_asked(run_work_dir(self.settings(host).home, job_id)) for host in self.worker_hosts)

    @contextmanager
    def held_at_a_checkpoint(self, job_id: str) -> Iterator[dict[str, int]]:
        """Freeze the job's runs (tests/run_holds.py) as soon as one of them has written a complete
        checkpoint, for the block; yields their pids by host name. The slots go on: the checkpoint
        reaches the store, and a host is lost or cut, or the job paused, while it is mid-run."""
        from trainer_core.checkpoint import newest_checkpoint

        def written() -> bool:
            return any(newest_checkpoint(run_work_dir(self.settings(host).home, job_id) / "output") is not None
                       for host in self.worker_hosts)  # fmt: skip

        wait_for("a checkpoint on a worker host's disk", written, timeout=240, every=0.01)
        pids = self.run_pids(job_id)
        with held(pids.values()):
            yield pids

    def stop_workers(self, queue: str) -> None:
        """End every worker host's processes and give each a fresh disk; forget ``queue``'s messages."""
        for host in self.worker_hosts:
            host.reconnect()
            host.kill_all()
            host.fresh_disk()
        client = redis.Redis(host="127.0.0.1", port=6379, db=REDIS_DB)
        for key in client.scan_iter(match=f"*{queue}*"):
            client.delete(key)


@contextmanager
def fleet(root: Path, workers: int = 2, leases: dict[str, str] | None = None) -> Iterator[Fleet]:
    """Start the network, the store, the forwarders, a fresh database and the API host; tear all down.

    ``leases`` overrides :data:`SHORT_LEASES` (the lease, renew, sweep and redelivery variables)."""
    with ExitStack() as stack:
        network = stack.enter_context(Network(root / "disks"))
        gateway = network.gateway
        store = stack.enter_context(SeaweedFS(data_dir=root / "store", ip=gateway))
        pg = stack.enter_context(TcpProxy(("127.0.0.1", 5432), host=gateway))
        broker = stack.enter_context(TcpProxy(("127.0.0.1", 6379), host=gateway))
        db_name, local_url = create_pg_database("trainjobs_fleet")
        stack.callback(drop_pg_database, db_name)
        stack.callback(get_engine(local_url).dispose)
        env = {
            **(leases or SHORT_LEASES),
            "DATABASE_URL": local_url.replace("@127.0.0.1:5432/", f"@{gateway}:{pg.port}/"),
            "BROKER_URL": f"redis://{gateway}:{broker.port}/{REDIS_DB}",
            "ARTIFACTS_ROOT": store.url("artifacts"),
            "DATA_ROOT": store.url("data"),
        }
        result = Fleet(root=root, network=network, store=store, env=env, database_url=local_url)
        stack.callback(network.kill_all)  # before the database goes
        Base.metadata.create_all(get_engine(local_url))
        api = network.add_host("api")
        for index in range(workers):
            network.add_host(f"worker-{'abcdefgh'[index]}")
        with session_scope(local_url) as session:
            result.api_key = create_api_key(session, "alice", settings=result.settings(api))
        log = result.log(api, "api")
        process = api.spawn([sys.executable, "-m", "uvicorn", "--factory", "api.main:create_app", "--host",
                             api.address, "--port", str(API_PORT), "--log-level", "warning"],
                            result.host_env(api), log)  # fmt: skip
        wait_for("the API host", lambda: _answers(result.url + "/healthz") or _exited(process, log), timeout=90)
        yield result


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2, trust_env=False).status_code == 200
    except httpx.TransportError:
        return False


def _exited(process: Any, log: Path) -> bool:
    if process.poll() is not None:
        raise RuntimeError(f"the API host's server exited:\n{log.read_text()[-3000:]}")
    return False


def new_queue() -> str:
    return f"fleet-{uuid.uuid4().hex[:8]}"


def upload_csv(client: httpx.Client, path: Path) -> dict[str, Any]:
    """POST /v1/datasets with one CSV file; returns the stored dataset."""
    with path.open("rb") as handle:
        response = client.post("/v1/datasets", files={"file": (path.name, handle, "text/csv")})
    assert response.status_code == 201, response.text
    body: dict[str, Any] = response.json()
    return body


def dataset_spec(dataset_id: str, **training: Any) -> dict[str, Any]:
    """A tiny text-classification job on an uploaded dataset (8 rows a step, no evaluation)."""
    spec = quick_spec({}, eval_strategy="no", **training)
    spec["dataset"] = {"id": dataset_id, "text_column": "text", "label_column": "label"}
    spec.pop("metrics", None)
    return spec
