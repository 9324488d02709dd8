"""Leases, fencing and the outbox with real worker processes and short lease settings, on the
embedded default (SQLite + the SQLite broker) and on PostgreSQL + Redis.

- A job whose queue message was never sent (a crash between INSERT and send), or was lost by the
  broker, is sent again by the sweep and runs, once.
- A slot frozen (SIGSTOP) past its lease loses its job to another worker; when it wakes up, its writes
  are refused, it kills its stale run, and the job ends once, with no event after its final status (on
  SQLite, where a slot frozen inside a write holds the whole database; tests/fleet/test_host_loss.py
  checks the same on PostgreSQL + Redis, with a host cut off from the network).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis
from sqlalchemy import select

from service_core.db import Base, Job, JobEvent
from service_core.db.base import utcnow
from service_core.db.jobstore import insert_job
from service_core.db.session import get_engine, session_scope
from service_core.queue import enqueue_job
from service_core.settings import Settings
from tests.trainer_core.datagen import write_sentiment_csv
from worker.procfs import is_alive, process_state

from .conftest import create_pg_database, drop_pg_database, load_job, make_settings, quick_spec
from .live import processes_mentioning, service_env, stop
from .test_recovery import queued_ids

pytestmark = pytest.mark.slow
REDIS_DB = 12  # this file's own Redis database; queue names are unique per test as well
# Seconds: a lease of 3 renewed twice a second, a sweep every second, lost messages re-sent after 2.
SHORT = {"TRAINJOBS_LEASE_SECONDS": "3", "TRAINJOBS_LEASE_RENEW_SECONDS": "0.5",
         "TRAINJOBS_SWEEP_SECONDS": "1", "TRAINJOBS_REDELIVER_AFTER_SECONDS": "2"}  # fmt: skip
TERMINAL = {"succeeded", "failed", "cancelled"}


@dataclass
class Deployment:
    """Shared database, broker and artifacts; each worker has a home (a machine) of its own."""

    root: Path
    queue: str
    env: dict[str, str]
    kind: str

    def settings(self, machine: str = "a") -> Settings:
        return make_settings(self.root / machine, **self.env)

    def drop_messages(self) -> None:
        """The broker loses every message of the queue (a Redis without persistence restarting)."""
        if self.kind == "embedded":
            queued_ids(self.settings(), self.queue)
            return
        client = redis.Redis(host="127.0.0.1", port=6379, db=REDIS_DB)
        for key in client.scan_iter(match=f"*{self.queue}*"):
            client.delete(key)


@pytest.fixture(params=["embedded", "postgres-redis"])
def deployment(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Deployment]:
    queue = f"lease-{uuid.uuid4().hex[:8]}"
    shared = tmp_path / "shared"
    shared.mkdir()
    # One data root for both machines (a shared mount): the run re-checks its paths under it.
    env = {**SHORT, "ARTIFACTS_ROOT": str(shared / "artifacts"), "DATA_ROOT": str(shared / "data")}
    pg_name = None
    if request.param == "embedded":
        env.update(
            DATABASE_URL=f"sqlite:///{shared / 'trainjobs.db'}", BROKER_URL=f"sqla+sqlite:///{shared / 'broker.db'}"
        )
    else:
        pg_name, url = create_pg_database("trainjobs_lease")
        env.update(DATABASE_URL=url, BROKER_URL=f"redis://127.0.0.1:6379/{REDIS_DB}")
    for machine in ("a", "b"):
        (tmp_path / machine).mkdir()
    dep = Deployment(tmp_path, queue, env, request.param)
    Base.metadata.create_all(get_engine(env["DATABASE_URL"]))
    try:
        yield dep
    finally:
        for pid in processes_mentioning(queue) + processes_mentioning(str(tmp_path)):
            os.kill(pid, signal.SIGKILL)
        get_engine(env["DATABASE_URL"]).dispose()
        if pg_name:
            dep.drop_messages()
            drop_pg_database(pg_name)


@pytest.fixture
def workers(deployment: Deployment) -> Iterator[Callable[[str], subprocess.Popen[bytes]]]:
    """Start ``python -m worker.main`` on a machine of the deployment; all are stopped at the end."""
    started: list[subprocess.Popen[bytes]] = []

    def start(machine: str) -> subprocess.Popen[bytes]:
        with (deployment.root / f"worker-{machine}.log").open("ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "worker.main", "--queues", deployment.queue],
                env=service_env(deployment.settings(machine)), stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        started.append(proc)
        return proc

    yield start
    for pid in processes_mentioning(deployment.queue):  # a frozen slot cannot stop: wake every slot first
        os.kill(pid, signal.SIGCONT)
    for proc in started:
        stop(proc, 60)


def submit(settings: Settings, spec: dict, *, send: bool, queue: str) -> str:
    """Store a job as the API does (stamped as sent in the INSERT), and send its message if ``send``."""
    with get_engine(settings.database_url).connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        job = insert_job(conn, owner="alice", name="lease", queue=queue, spec=spec, enqueued_at=utcnow())
    if send:
        enqueue_job(job.id, queue, 0, settings)
    return job.id


def wait_for(what: str, check: Callable[[], bool], timeout: float = 90, every: float = 0.2) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)


def status_events(settings: Settings, job_id: str) -> list[tuple[int, str, dict]]:
    with session_scope(settings.database_url) as s:
        rows = s.execute(select(JobEvent.seq, JobEvent.kind, JobEvent.data).where(JobEvent.job_id == job_id))
        return sorted((seq, kind, data) for seq, kind, data in rows)


def test_jobs_never_sent_or_lost_by_the_broker_run_once(deployment: Deployment, workers: Callable) -> None:
    settings = deployment.settings()
    # An empty spec: the run starts and fails at once, which is all this test needs to see: a worker
    # got the job and ran it, once.
    never_sent = submit(settings, {}, send=False, queue=deployment.queue)  # crashed before the send
    with session_scope(settings.database_url) as s:  # and before the stamp: a row that is no record of a send
        s.get_one(Job, never_sent).enqueued_at = None
    lost = submit(settings, {}, send=True, queue=deployment.queue)
    deployment.drop_messages()
    workers("a")
    for job_id in (never_sent, lost):
        wait_for(f"job {job_id} to end", lambda job_id=job_id: load_job(settings, job_id).status in TERMINAL)
        job = load_job(settings, job_id)
        assert (job.status, job.attempts) == ("failed", 1)
        assert "Field required" in (job.error_message or "")  # the run itself read the spec


# On SQLite: on PostgreSQL + Redis, tests/fleet/test_host_loss.py's host cut off past its lease checks
# the same (another host's attempt, the stale run killed, "fenced out", nothing after the final status).
@pytest.mark.parametrize("deployment", ["embedded"], indirect=True)
def test_a_frozen_slot_is_fenced_out_and_the_job_ends_once(
    deployment: Deployment, workers: Callable, tmp_path: Path
) -> None:
    a, b = deployment.settings("a"), deployment.settings("b")
    files = write_sentiment_csv(tmp_path / "shared" / "data", n_train=64, n_val=16)
    # 64 steps (~20 ms each on an idle machine) with a checkpoint every 5: it is frozen mid-run.
    spec = quick_spec(files, num_train_epochs=8, eval_strategy="no", save_steps=5)
    job_id = submit(a, spec, send=True, queue=deployment.queue)
    workers("a")
    wait_for("a checkpoint of attempt 1", lambda: load_job(a, job_id).progress_step >= 6)
    slot = load_job(a, job_id).pid
    assert slot is not None
    run = int((a.home / "runs" / job_id / "run.pid").read_text())
    os.killpg(run, signal.SIGSTOP)  # the machine hangs: run and slot alike
    freeze(slot, deployment)
    workers("b")
    wait_for(
        "attempt 2 to run elsewhere",
        lambda: (load_job(b, job_id).attempts, load_job(b, job_id).status) == (2, "running"),
    )
    os.kill(slot, signal.SIGCONT)  # the stale slot wakes up while attempt 2 runs
    wait_for("the stale run to be killed", lambda: not is_alive(run), timeout=30)
    # Generous: a busy 2-core machine takes over a minute for what an idle one does in seconds.
    wait_for("the job to end", lambda: load_job(b, job_id).status in TERMINAL, timeout=240)

    job = load_job(b, job_id)
    assert (job.status, job.attempts, job.progress_step) == ("succeeded", 2, job.progress_total)
    events = status_events(b, job_id)
    statuses = [data["status"] for _seq, kind, data in events if kind == "status"]
    assert statuses == ["running", "queued", "running", "succeeded"]
    assert events[-1][1:] == ("status", events[-1][2]) and events[-1][2]["status"] == "succeeded"  # nothing after it
    # The stale slot kills its run, then logs why: the test may see the run gone before the line is out.
    log = deployment.root / "worker-a.log"
    with contextlib.suppress(AssertionError):  # the assertion below says it, with the stale worker's log
        wait_for("the stale slot to say it was fenced out", lambda: "fenced out" in log.read_text(), timeout=30)
    assert "fenced out" in log.read_text(), log.read_text()[-6000:]


def freeze(pid: int, deployment: Deployment) -> None:
    """SIGSTOP ``pid``; on SQLite at a moment it holds no write lock (there a process frozen while it
    writes holds the whole database file; PostgreSQL ends such a transaction after a lease, see
    worker/main.py:slot_database_url)."""
    db_file = deployment.env["DATABASE_URL"].removeprefix("sqlite:///")
    for _ in range(100):
        os.kill(pid, signal.SIGSTOP)
        wait_for("the slot to stop", lambda: process_state(pid) == "T", timeout=10)
        if deployment.kind != "embedded" or sqlite_writable(db_file):
            return
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.05)
    raise AssertionError("the slot never paused outside a write transaction")


def sqlite_writable(path: str) -> bool:
    conn = sqlite3.connect(path, timeout=0.2, isolation_level=None)
    try:
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("ROLLBACK")
        return True
    except sqlite3.OperationalError:
        return False
    finally:
        conn.close()


def attempt_and_status(settings: Settings, job_id: str) -> tuple[int, str]:
    job = load_job(settings, job_id)
    return job.attempts, job.status
