"""Event-stream bench (issue 13, P6/P7 "SSE pushed, not polled"): many SSE followers on one API process.

One run creates a fresh PostgreSQL database and claims an empty Redis database, stores ``--jobs`` (50)
running jobs, starts one API process (``trainjobs serve --api-processes 1``) and then, for each follower count
of ``--followers`` (10, 100, 1000):

1. opens that many ``GET /v1/jobs/{id}/events`` streams, spread round-robin over the jobs, each resuming
   after the job's last event (``Last-Event-ID``), so nothing is replayed;
2. starts a writer process that appends ``metric`` events through ``add_events`` (the call the worker's
   ingestion makes, one transaction per event) at ``--rate`` events/s per job, stamping ``sent`` (wall
   clock) into each event's data, and records the metric-to-client delay (receive time - ``sent``) of
   every event every follower gets, for ``--seconds`` after a warm-up;
3. stops the writer and counts the database's committed transactions (``pg_stat_database.xact_commit``
   of the bench database, read from another database) over ``--idle-seconds``: queries/s while no new
   events arrive;
4. samples the API process's RSS (VmRSS) every second throughout, and keeps the peak.

The followers share one ``httpx.AsyncClient`` and parse with httpx-sse (the parser the client and the tests use).
Goals, judged on the largest follower count: delay p50 <= 100 ms and p99 <= 500 ms, <= 50 queries/s
idle, RSS < 1 GiB. Prints PASS/MISS, exits 1 on a miss. Everything it starts is stopped, the database
dropped and the Redis database flushed at the end, also on errors and Ctrl-C.

    .venv/bin/python bench/bench_streams.py [--followers 10,100,1000] [--jobs 50] [--rate 1] [--seconds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import AsyncExitStack, contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psycopg
import redis
from httpx_sse import aconnect_sse
from sqlalchemy import select

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_api import PG_ADMIN, REDIS_HOST, REDIS_PORT, claim_redis_db, free_port, percentile, service_env

from service_core.db import Base
from service_core.db.jobstore import add_events, transition
from service_core.db.models import Job
from service_core.db.session import make_engine, session_scope
from service_core.keys import create_api_key
from service_core.settings import Settings
from service_core.status import JobStatus
from worker.processes import stop_processes
from worker.procfs import all_processes, proc_stat, status_field

REPO = Path(__file__).resolve().parents[1]
GOAL_P50_MS, GOAL_P99_MS, GOAL_IDLE_QPS, GOAL_RSS_MIB = 100.0, 500.0, 50.0, 1024.0
WARMUP_S, SETTLE_S = 3.0, 5.0
CONNECT_AT_ONCE = 50  # streams opened concurrently (the listen backlog is not the thing measured)


@dataclass
class Round:
    followers: int
    delays: list[float] = field(default_factory=list)
    idle_qps: float = 0.0
    rss_mib: float = 0.0
    cpu_s: float = 0.0  # the API process's CPU time while the delays were recorded
    write_ms: tuple[float, float] = (0.0, 0.0)  # the writer's stamp-to-commit p50, p99


@dataclass
class Service:
    url: str
    key: str
    database_url: str
    db_name: str
    job_ids: list[str]
    api: subprocess.Popen[bytes]
    pid: int = 0  # the API process (`trainjobs serve --api-processes 1` serves in its own process)


def api_pid(serve_pid: int) -> int:
    """The API process: ``trainjobs serve`` itself with one worker, else its child (several: the first)."""
    return next((p.pid for p in all_processes() if p.ppid == serve_pid), serve_pid)


def rss_mib(pid: int) -> float:
    rss = status_field(pid, "VmRSS")
    if rss is None:
        raise RuntimeError(f"no VmRSS for {pid}")
    return int(rss.split()[0]) / 1024


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` so far."""
    stat = proc_stat(pid)
    if stat is None:
        raise RuntimeError(f"no process {pid}")
    return stat.cpu_ticks / os.sysconf("SC_CLK_TCK")


def xact_commits(db_name: str) -> int:
    # A fresh connection to another database: the reading itself is not counted, and the snapshot is new.
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        row = conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = %s", (db_name,)).fetchone()
    assert row is not None
    return int(row[0])


@contextmanager
def running_api(jobs: int, max_streams: int) -> Iterator[Service]:
    """One API process on a fresh database with ``jobs`` running jobs; everything removed afterwards."""
    tag = uuid.uuid4().hex[:10]
    home = Path(tempfile.mkdtemp(prefix=f"trainjobs-bench-streams-{tag}-"))
    db_name = f"trainjobs_bench_streams_{tag}"
    redis_db: int | None = None
    api: subprocess.Popen[bytes] | None = None
    try:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{db_name}"')
        redis_db = claim_redis_db(tag)
        env_settings = {
            "TRAINJOBS_HOME": str(home),
            "DATABASE_URL": f"postgresql+psycopg://postgres@127.0.0.1:5432/{db_name}",
            "BROKER_URL": f"redis://{REDIS_HOST}:{REDIS_PORT}/{redis_db}",
            "TRAINJOBS_MAX_STREAMS_PER_OWNER": str(max_streams),
            "TRAINJOBS_MAX_STREAMS": str(max_streams),
        }
        settings = Settings.model_validate(env_settings)
        engine = make_engine(settings.database_url)
        Base.metadata.create_all(engine)
        engine.dispose()
        with session_scope(settings.database_url) as session:
            key = create_api_key(session, "bench", settings=settings)
            job_ids = []
            for i in range(jobs):
                job = Job(owner="bench", name=f"stream-{i}", spec={}, status=JobStatus.queued.value)
                session.add(job)
                session.flush()
                transition(session, job.id, JobStatus.running)
                job_ids.append(job.id)
        port = free_port()
        with (home / "api.log").open("wb") as log:
            api = subprocess.Popen(
                [sys.executable, "-m", "trainjobs.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                 "--api-processes", "1", "--no-access-log"],
                env=service_env(env_settings), cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        service = Service(f"http://127.0.0.1:{port}", key, settings.database_url, db_name, job_ids, api)
        wait_until_warm(service)
        service.pid = api_pid(api.pid)
        yield service
    except BaseException:
        with suppress(OSError):
            sys.stderr.write((home / "api.log").read_text(errors="replace")[-3000:])
        raise
    finally:
        if api is not None:
            stop_processes([api], 30, "API")
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')
        if redis_db is not None:
            redis.Redis(host=REDIS_HOST, port=REDIS_PORT, db=redis_db).flushdb()
        shutil.rmtree(home, ignore_errors=True)


def wait_until_warm(service: Service, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if service.api.poll() is not None:
            raise RuntimeError("the API exited during start-up")
        with suppress(httpx.TransportError):
            answer = httpx.get(f"{service.url}/readyz", timeout=5)
            if answer.status_code == 200 and answer.json().get("warmed_up") is True:
                return
        time.sleep(0.3)
    raise TimeoutError("the API was not warm in time")


def drive(database_url: str, job_ids: list[str], rate_per_job: float) -> None:
    """The writer process: metric events round-robin over the jobs until SIGTERM, one commit each.

    On SIGTERM it finishes the write under way and prints how long its writes took (stamp to committed),
    p50 and p99 in ms: the part of the delay before the API could know of the event.
    """
    writes: list[float] = []
    stopping = False

    def stop(*_: object) -> None:
        # A flag, not sys.exit here: raised inside SQLAlchemy's connection reset, SystemExit was logged
        # as "Exception during reset" in the middle of the bench's output.
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    period = 1.0 / (rate_per_job * len(job_ids))
    with session_scope(database_url) as session:
        session.execute(select(1))  # connected: the imports and the first connection are behind us
    print("ready", flush=True)
    step, next_at = 0, time.monotonic()
    while not stopping:
        for job_id in job_ids:
            next_at += period
            time.sleep(max(0.0, next_at - time.monotonic()))
            if stopping:
                break
            sent = time.time()
            with session_scope(database_url) as session:
                add_events(session, job_id, [("metric", {"step": step, "values": {"loss": 1.0}, "sent": sent}, None)])
            writes.append(time.time() - sent)
        step += 1
    print(json.dumps([percentile(writes, q) * 1000 if writes else 0.0 for q in (50, 99)]), flush=True)


class Followers:
    """Open SSE connections on one httpx.AsyncClient, parsed by httpx-sse; delays recorded while ``recording``."""

    def __init__(self, service: Service) -> None:
        self.service, self.recording = service, False
        self.delays: list[float] = []
        self.tasks: list[asyncio.Task[None]] = []
        # No pool limit (every follower holds its connection), no read timeout (an idle stream is quiet).
        self.client = httpx.AsyncClient(
            base_url=service.url, headers={"Authorization": f"Bearer {service.key}"},
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=0),
            timeout=httpx.Timeout(30, read=None),
        )  # fmt: skip

    async def open(self, count: int, last_seqs: dict[str, int]) -> None:
        gate = asyncio.Semaphore(CONNECT_AT_ONCE)
        opened = [asyncio.get_running_loop().create_future() for _ in range(count)]
        jobs = self.service.job_ids
        for i in range(count):
            job_id = jobs[i % len(jobs)]
            self.tasks.append(asyncio.create_task(self.follow(job_id, last_seqs[job_id], gate, opened[i])))
        await asyncio.gather(*opened)

    async def follow(self, job_id: str, after: int, gate: asyncio.Semaphore, opened: asyncio.Future[None]) -> None:
        headers = {"Last-Event-ID": str(after)}
        async with AsyncExitStack() as stack:
            async with gate:
                url = f"/v1/jobs/{job_id}/events"
                source = await stack.enter_async_context(aconnect_sse(self.client, "GET", url, headers=headers))
                if source.response.status_code != 200:
                    opened.set_exception(RuntimeError(f"stream answered {source.response.status_code}"))
                    return
            opened.set_result(None)
            async for event in source.aiter_sse():
                if event.data and self.recording:  # (a keep-alive after an id comes as an event without data)
                    self.delays.append(time.time() - json.loads(event.data)["sent"])

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.client.aclose()


def last_seqs(database_url: str) -> dict[str, int]:
    with session_scope(database_url) as session:
        return {job_id: int(seq) for job_id, seq in session.execute(select(Job.id, Job.last_seq))}


async def measure(service: Service, count: int, args: argparse.Namespace) -> Round:
    result = Round(count)
    peak = 0.0

    async def sample_rss() -> None:
        nonlocal peak
        while True:
            peak = max(peak, rss_mib(service.pid))
            await asyncio.sleep(1)

    sampler = asyncio.create_task(sample_rss())
    followers = Followers(service)
    await followers.open(count, last_seqs(service.database_url))
    writer = subprocess.Popen(
        [sys.executable, __file__, "--drive", service.database_url, "--rate", str(args.rate),
         "--job-ids", ",".join(service.job_ids)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
    )  # fmt: skip
    try:
        assert writer.stdout is not None
        await asyncio.to_thread(writer.stdout.readline)  # "ready"
        await asyncio.sleep(WARMUP_S)
        followers.recording, cpu_before = True, cpu_seconds(service.pid)
        await asyncio.sleep(args.seconds)
        followers.recording, result.cpu_s = False, cpu_seconds(service.pid) - cpu_before
    finally:
        stop_processes([writer], 10, "event writer")
    result.write_ms = tuple(json.loads(writer.stdout.readline() or "[0, 0]"))
    await asyncio.sleep(SETTLE_S)  # the last events delivered, the statistics flushed
    before = await asyncio.to_thread(xact_commits, service.db_name)
    await asyncio.sleep(args.idle_seconds)
    after = await asyncio.to_thread(xact_commits, service.db_name)
    result.idle_qps = (after - before) / args.idle_seconds
    await followers.close()
    sampler.cancel()
    result.delays, result.rss_mib = followers.delays, peak
    return result


def report(rounds: list[Round], args: argparse.Namespace) -> bool:
    load = "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    print(f"\nSSE followers on one API process, {args.jobs} running jobs, {args.rate:g} metric/s per job ({load})")
    print(f"{'followers':>10} {'events got':>11} {'of ~':>7} {'p50 ms':>8} {'p99 ms':>8} {'commit p50/p99':>15}"
          f" {'API CPU':>8} {'idle q/s':>9} {'RSS MiB':>8}")  # fmt: skip
    for r in rounds:
        p50, p99 = (percentile(r.delays, q) * 1000 for q in (50, 99)) if r.delays else (float("nan"),) * 2
        expected = r.followers * args.rate * args.seconds  # each follower's job gets `rate` events/s
        cpu = f"{100 * r.cpu_s / args.seconds:.0f}%"
        commit = "{:.0f}/{:.0f} ms".format(*r.write_ms)
        print(f"{r.followers:>10} {len(r.delays):>11} {expected:>7.0f} {p50:>8.1f} {p99:>8.1f} {commit:>15}"
              f" {cpu:>8} {r.idle_qps:>9.2f} {r.rss_mib:>8.0f}")  # fmt: skip
    top = rounds[-1]
    p50, p99 = (percentile(top.delays, q) * 1000 for q in (50, 99))
    goals = [
        (f"delay p50 <= {GOAL_P50_MS:.0f} ms", p50 <= GOAL_P50_MS, f"{p50:.1f} ms"),
        (f"delay p99 <= {GOAL_P99_MS:.0f} ms", p99 <= GOAL_P99_MS, f"{p99:.1f} ms"),
        (f"idle queries <= {GOAL_IDLE_QPS:.0f}/s", top.idle_qps <= GOAL_IDLE_QPS, f"{top.idle_qps:.2f}/s"),
        (f"API RSS < {GOAL_RSS_MIB:.0f} MiB", top.rss_mib < GOAL_RSS_MIB, f"{top.rss_mib:.0f} MiB"),
    ]
    print(f"\nGoals at {top.followers} followers:")
    for name, ok, value in goals:
        print(f"  {'PASS' if ok else 'MISS'}  {name:<26} {value}")
    return all(ok for _, ok, _ in goals)


async def run(args: argparse.Namespace) -> bool:
    counts = [int(n) for n in args.followers.split(",")]
    with running_api(args.jobs, max(counts) + 10) as service:
        rounds = []
        for count in counts:
            rounds.append(await measure(service, count, args))
            print(f"  {count} followers: done", flush=True)
        return report(rounds, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--followers", default="10,100,1000", help="comma-separated follower counts")
    parser.add_argument("--jobs", type=int, default=50)
    parser.add_argument("--rate", type=float, default=1.0, help="metric events per second per job")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured seconds per follower count")
    parser.add_argument("--idle-seconds", type=float, default=20.0, help="seconds the idle queries are counted")
    parser.add_argument("--drive", help=argparse.SUPPRESS)  # the writer process: its database URL
    parser.add_argument("--job-ids", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.drive:
        drive(args.drive, args.job_ids.split(","), args.rate)
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)  # two sockets per follower, client and API
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, 8192)), hard))
    sys.exit(0 if asyncio.run(run(args)) else 1)


if __name__ == "__main__":
    main()
