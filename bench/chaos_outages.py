"""Chaos scenarios on the infrastructure: Redis, API and database restarts or outages (R3, R7), the
launcher killed (R10), and a frozen slot that wakes up stale (R6, R8: these need leases and fencing)."""

from __future__ import annotations

import inspect
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psycopg
from sqlalchemy.engine import make_url

from bench.bench_api import free_port, service_env
from bench.chaos_checks import Row, job_facts, judge
from bench.chaos_scenarios import START_S, job_row, mid_training, run_pid, running_again, wait_terminal
from bench.chaos_service import API_KEY, PG_ADMIN, REPO, RedisServer, Service, processes_of, wait_for
from service_core.status import ErrorReason, JobStatus
from worker.procfs import is_alive, process_state

SETTLE_S = 30.0  # after an outage: the outcome's backoff, a lease to expire and a sweep


def db_outage(svc: Service, row: Row, seconds: float) -> None:
    """Cut the database for ``seconds``: every API answer meanwhile must be 503; after, 200 again."""
    assert svc.proxy is not None
    svc.proxy.cut()
    answers: list[int] = []
    unexpected = ""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        answers.append(svc.answers("/v1/jobs"))
        if answers[-1] != 503 and not unexpected:
            unexpected = f": {answers[-1]} {svc.last_body}"
        time.sleep(1.0)
    svc.proxy.restore()
    restored = time.monotonic()
    if not answers or any(code != 503 for code in answers):
        row.fail(f"API answered {sorted(set(answers))} while the database was away (want only 503){unexpected}")
    try:
        wait_for(lambda: svc.answers("/v1/jobs") == 200, 60, "the API to recover after the outage", 0.5)
        row.recovered(time.monotonic() - restored)
    except TimeoutError as exc:
        row.fail(str(exc))


def r3_queue_and_restart(svc: Service, queued: int) -> list[str]:
    """R3, first half, before any worker consumes: queue jobs, then SIGKILL and restart Redis (production)
    and the API."""
    ids = [svc.submit(f"r3-{i}", {"max_steps": 60, "save_steps": 20}) for i in range(queued)]
    if svc.redis is not None:
        time.sleep(2.0)  # the AOF is fsynced every second
        svc.redis.kill()
        svc.redis.start()
    svc.kill_api()
    svc.start_api()
    return ids


def r3_finish(svc: Service, ids: list[str]) -> Row:
    """R3, second half, once workers run. Production: block the database 10 s while the jobs run.
    Embedded (no server to block): SIGKILL both workers, which hold the embedded broker's messages, and
    start two new ones. All jobs must finish."""
    production = svc.proxy is not None
    note = "recovery = API back after the database block" if production else (
        "API + workers SIGKILLed with jobs queued; recovery = kill to the killed runs running again; "
        "Redis restart and PostgreSQL block n/a (no server)")  # fmt: skip
    row = Row("R3", svc.shape, note=note)
    try:
        wait_for(lambda: any(job_row(svc, j).status == JobStatus.running for j in ids), START_S, "an R3 job to run")
        if production:
            db_outage(svc, row, 10.0)
        else:
            restart_workers(svc, row, ids)
    except TimeoutError as exc:
        row.fail(str(exc))
    judge_succeeded(svc, row, ids)
    return row


def judge_succeeded(svc: Service, row: Row, ids: list[str]) -> None:
    """Wait for ``ids`` to end, then count each as a trial that must have succeeded."""
    wait_terminal(svc, ids)
    for job_id in ids:
        row.add(judge(job_facts(svc.observer_url, job_id), JobStatus.succeeded))
        row.trials += 1


def restart_workers(svc: Service, row: Row, ids: list[str]) -> None:
    """SIGKILL every worker main (their slots die with them) and start as many new workers; the jobs
    that ran must run again (lease expiry and the sweep), the queued ones be delivered again."""
    attempts = {j: job_row(svc, j).attempts for j in ids if job_row(svc, j).status == JobStatus.running}
    mains = svc.live_workers()
    for worker in mains:
        worker.kill()
    killed = time.monotonic()
    for worker in mains:
        worker.wait()
    for _ in mains:
        svc.start_worker(wait=False)
    wait_for(lambda: all(running_again(svc, j, n) for j, n in attempts.items()), START_S, "R3: killed runs again")
    row.recovered(time.monotonic() - killed)


def r7_db_outages(svc: Service, outages: list[float]) -> Row:
    """R7: the database away for each of ``outages`` seconds during runs: runs go on or resume, the API
    says 503 meanwhile, and nothing is ``running`` without a process afterwards."""
    row = Row("R7", svc.shape, note="outages " + "/".join(f"{s:.0f}" for s in outages) + " s")
    for seconds in outages:
        ids = [svc.submit("r7", {"max_steps": 400, "save_steps": 50}) for _ in range(len(svc.live_workers()))]
        try:
            wait_for(lambda: all(job_row(svc, j).progress_step >= 3 for j in ids), START_S, "R7 jobs running")  # noqa: B023
            db_outage(svc, row, seconds)
            # A run that ended during the outage leaves its job `running` until the outcome is written
            # (backoff); what must not happen is a job left so, with no process, for good.
            try:
                wait_for(lambda: all(not orphaned(svc, j) for j in ids), SETTLE_S, "no orphan", 0.5)  # noqa: B023
            except TimeoutError:
                for job_id in [j for j in ids if orphaned(svc, j)]:
                    row.fail(f"{job_id}: running without a process {SETTLE_S:.0f} s after the outage")
        except TimeoutError as exc:
            row.fail(str(exc))
        judge_succeeded(svc, row, ids)
    return row


def orphaned(svc: Service, job_id: str) -> bool:
    """``running`` with no live run process."""
    return job_row(svc, job_id).status == JobStatus.running and not is_alive(run_pid(svc, job_id))


def listening(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def r10_launcher(trials: int, shape: str = "embedded") -> Row:
    """R10: SIGKILL or SIGHUP ``trainjobs dev``: nothing of it is left running or listening. On the
    production shape ``dev`` runs on a fresh PostgreSQL database and a Redis of its own."""
    row = Row("R10", shape, note="recovery = signal to nothing left")
    for trial in range(trials):
        sig = (signal.SIGKILL, signal.SIGHUP)[trial % 2]
        home = Path(tempfile.mkdtemp(prefix="trainjobs-chaos-dev-"))
        port = free_port()
        settings = {"TRAINJOBS_HOME": str(home), "TRAINJOBS_CANCEL_GRACE_SECONDS": "5"}
        redis: RedisServer | None = None
        db_name = f"trainjobs_chaos_dev_{home.name.rsplit('-', 1)[-1].lower()}"
        if shape == "production":
            redis = RedisServer(home / "redis")
            redis.start()
            with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
                conn.execute(f'CREATE DATABASE "{db_name}"')
            settings |= {"DATABASE_URL": f"postgresql+psycopg://postgres@127.0.0.1:5432/{db_name}",
                         "BROKER_URL": f"redis://127.0.0.1:{redis.port}/0"}  # fmt: skip
        env = service_env(settings)
        env["TRAINJOBS_API_KEY"] = API_KEY
        with (home.parent / f"{home.name}.log").open("ab") as log:
            dev = subprocess.Popen([sys.executable, "-m", "trainjobs.cli", "dev", "--port", str(port)], cwd=REPO,
                                   env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        try:
            wait_for(lambda: dev.poll() is not None or _ready(port), 180, "trainjobs dev to come up", 0.5)  # noqa: B023
            dev.send_signal(sig)  # the launcher only: its children live in sessions of their own
            sent = time.monotonic()
            dev.wait(60)
            wait_for(lambda: not processes_of(home) and not listening(port), 90, f"{sig.name}: nothing left")  # noqa: B023
            row.recovered(time.monotonic() - sent)
        except (TimeoutError, subprocess.TimeoutExpired) as exc:
            row.fail(f"{sig.name}: {exc}; left: {processes_of(home)}")
        finally:
            for pid in processes_of(home):
                os.kill(pid, signal.SIGKILL)
            if dev.poll() is None:
                dev.kill()
                dev.wait()
            if redis is not None:
                redis.kill()
                with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
                    conn.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')
            shutil.rmtree(home, ignore_errors=True)
            home.parent.joinpath(f"{home.name}.log").unlink(missing_ok=True)
        row.trials += 1
    return row


def _ready(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


STALE_MESSAGE = "chaos bench: a stale worker's outcome"


def stale_write(svc: Service, job_id: str, attempt: int) -> bool:
    """A terminal write from attempt ``attempt`` (a stale worker); True when it was accepted.

    Accepted means a status event carrying this write's own message appeared. Comparing the job's
    status before and after instead counted the live attempt finishing in between as the stale write's
    doing (CI, R8 embedded: the job succeeded while the refused write ran, and the row was marked wrong).
    """
    from worker.execute import record_outcome
    from worker.outcome import RunOutcome

    def stale_events() -> int:
        return sum(1 for data in job_facts(svc.observer_url, job_id).statuses if data.get("message") == STALE_MESSAGE)

    before = stale_events()
    outcome = RunOutcome(JobStatus.failed, ErrorReason.internal, STALE_MESSAGE)
    if "attempt" in inspect.signature(record_outcome).parameters:
        record_outcome(job_id, svc.settings, outcome, attempt=attempt)  # type: ignore[call-arg,unused-ignore]
    else:
        record_outcome(job_id, svc.settings, outcome)
    return stale_events() > before


FREEZE_TRIES = 50  # a slot writes for milliseconds at a time: one of these freezes lands between writes


def sqlite_write_locks(svc: Service, pid: int) -> bool:
    """Whether ``pid`` holds a write lock on the embedded default's SQLite files (/proc/locks)."""
    url = make_url(svc.settings.database_url)
    if url.get_backend_name() != "sqlite" or not url.database:
        return False
    db = Path(url.database)
    inodes = {str(p.stat().st_ino) for p in (db, db.with_name(db.name + "-shm")) if p.exists()}
    # A holder's line: "1: POSIX  ADVISORY  WRITE PID MAJ:MIN:INODE START END" (a waiter's has "->").
    holders = (line.split() for line in Path("/proc/locks").read_text().splitlines())
    return any(
        len(f) >= 6 and f[3] == "WRITE" and f[4] == str(pid) and f[5].rsplit(":", 1)[-1] in inodes for f in holders
    )


def freeze_between_writes(svc: Service, slot: int) -> int:
    """SIGSTOP ``slot`` at a moment it holds no SQLite write lock; returns how many freezes it took.

    SQLite has one writer at a time, and the lock is the process's own: a slot stopped inside a write
    (its ingestor commits events every fraction of a second) stalls every other writer, the sweep that
    should move its job included, until it continues. That is SQLite's limit, not the fencing R6 checks
    (README "Operations"), so the freeze is retried until it lands between two writes.
    """
    for attempt in range(1, FREEZE_TRIES + 1):
        os.kill(slot, signal.SIGSTOP)
        while process_state(slot) not in ("T", "t"):
            time.sleep(0.001)
        if not sqlite_write_locks(svc, slot):
            return attempt
        os.kill(slot, signal.SIGCONT)
        time.sleep(0.05)
    raise TimeoutError(f"R6: slot {slot} held SQLite's write lock at each of {FREEZE_TRIES} freezes")


def r6_r8_stale_slot(svc: Service, trials: int) -> tuple[Row, Row]:
    """R6: SIGSTOP a slot past its lease, SIGCONT once its job runs elsewhere: the stale slot's writes
    are refused, one final status, nothing after it. R8: a stale attempt's terminal writes, while the
    new attempt runs and after it ended, are refused."""
    r6, r8 = Row("R6", svc.shape), Row("R8", svc.shape)
    for _ in range(trials):
        job_id = svc.submit("r6", {"max_steps": 600, "save_steps": 20}, resources={"max_restarts": 3})
        try:
            job = wait_for(lambda: mid_training(svc, job_id, 22), START_S, "R6 mid-training")  # noqa: B023
            slot = int(job.pid or 0)
            refrozen = freeze_between_writes(svc, slot) - 1
            if refrozen:
                r6.note = (r6.note + f" {refrozen} freeze(s) inside a SQLite write retried;").strip()
            frozen = time.monotonic()
            try:
                wait_for(lambda: running_again(svc, job_id, job.attempts), START_S, "R6: the job to run elsewhere")  # noqa: B023
                r6.recovered(time.monotonic() - frozen)
                for _ in range(2):  # "write a terminal status twice"
                    if job_row(svc, job_id).status == JobStatus.running and stale_write(svc, job_id, job.attempts):
                        r8.fail(f"{job_id}: a stale attempt's terminal write was accepted while attempt 2 ran")
                    r8.trials += 1
            finally:
                os.kill(slot, signal.SIGCONT)
        except TimeoutError as exc:
            r6.fail(str(exc))
        wait_terminal(svc, [job_id])
        r6.add(judge(job_facts(svc.observer_url, job_id), JobStatus.succeeded))
        if stale_write(svc, job_id, 1):
            r8.fail(f"{job_id}: a stale terminal write changed a finished job")
        r6.trials += 1
        r8.trials += 1
    return r6, r8
