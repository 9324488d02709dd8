"""Long history: API latency with 1,000 jobs / 100,000 metric points against 100,000 jobs / 10 million.

    .venv/bin/python bench/bench_history.py [--jobs 100000] [--points 10000000] [--requests 200]

Needs PostgreSQL and Redis (``bench_api.running_service``: a fresh database, the API under ``trainjobs
serve``). It seeds the small history with COPY, measures, grows the same database to the large
history, measures again, and prints per endpoint p50/p99 small and large and the growth of the p99
(goal: <= 1.2x, PASS/MISS):

- ``GET /v1/jobs`` first page and a deep keyset page (a cursor 90% of the way down the caller's jobs);
- ``GET /v1/jobs/{id}`` and ``GET /v1/jobs/{id}/metrics`` of one job with 100 points;
- ``GET /metrics`` (Prometheus);
- ``POST /v1/jobs`` (to a queue no worker consumes).

Half the jobs belong to the caller, half to 99 other owners; creation times spread over a year, points
are 100 per job. Finally ``trainjobs gc``'s work (``service_core.retention``) runs on the large history
for the jobs finished over 360 days ago, timed.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import random
import sys
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_api import Service, running_service, write_csv

GOAL = 1.2
POINTS_PER_JOB = 100
NOW = datetime.now(UTC)
SPEC = json.dumps({"name": "seeded", "task": "text-classification", "model": {"name_or_path": "bert-base-uncased"},
                   "dataset": {"path": "csv"}})  # fmt: skip


def pg_dsn(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def seed(dsn: str, first: int, jobs: int, points: int, caller: str, rng: random.Random) -> list[str]:
    """Jobs ``first``..``first+jobs-1`` and ``points`` metric points spread over them, with COPY."""
    ids = [f"{i:032x}" for i in range(first, first + jobs)]
    per_job = max(1, points // jobs)
    with psycopg.connect(dsn) as conn, conn.cursor() as cur:
        with cur.copy("COPY jobs (id, owner, name, status, queue, priority, spec, created_at, updated_at, "
                      "started_at, finished_at, progress_step, attempts, cancel_requested, last_seq) "
                      "FROM STDIN") as copy:  # fmt: skip
            buf = io.StringIO()
            for i, job_id in enumerate(ids):
                owner = caller if i % 2 == 0 else f"user{i % 99}"
                created = NOW - timedelta(seconds=rng.uniform(0, 365 * 86400))
                finished = created + timedelta(seconds=rng.uniform(30, 3600))
                status = "failed" if i % 10 == 0 else "succeeded"
                buf.write(f"{job_id}\t{owner}\tjob-{i}\t{status}\tdefault\t0\t{SPEC}\t{created.isoformat()}\t"
                          f"{finished.isoformat()}\t{created.isoformat()}\t{finished.isoformat()}\t{per_job}\t1\tf\t"
                          f"{per_job}\n")  # fmt: skip
            copy.write(buf.getvalue())
        stamp = NOW.isoformat()
        with cur.copy("COPY metric_points (job_id, seq, step, name, value, time) FROM STDIN") as copy:
            chunk = 20_000 // per_job + 1  # jobs per write: a few MB of text at a time
            for start in range(0, len(ids), chunk):
                copy.write("".join(
                    f"{job_id}\t{s + 1}\t{s + 1}\tloss\t{1.0 / (s + 1):.6f}\t{stamp}\n"
                    for job_id in ids[start:start + chunk] for s in range(per_job)
                ))  # fmt: skip
        conn.execute("ANALYZE jobs")
        conn.execute("ANALYZE metric_points")
    return ids


def deep_cursor(dsn: str, caller: str) -> str:
    """The cursor of the job 90% of the way down the caller's list (newest first)."""
    from api.schemas.jobs import Cursor

    with psycopg.connect(dsn) as conn:
        total = conn.execute("SELECT count(*) FROM jobs WHERE owner = %s", (caller,)).fetchone()[0]  # type: ignore[index]
        row = conn.execute("SELECT created_at, id FROM jobs WHERE owner = %s ORDER BY created_at DESC, id DESC "
                           "OFFSET %s LIMIT 1", (caller, int(total * 0.9))).fetchone()  # fmt: skip
    assert row is not None
    return Cursor(created_at=row[0], id=row[1]).encode()


def timed(client: httpx.Client, method: str, path: str, expect: int, n: int, body: Any = None) -> list[float]:
    """``n`` sequential requests after ``n // 10`` unmeasured ones; seconds each."""
    out = []
    for i in range(n + n // 10):
        started = time.perf_counter()
        answer = client.request(method, path, json=body)
        elapsed = time.perf_counter() - started
        assert answer.status_code == expect, (path, answer.status_code, answer.text[:300])
        if i >= n // 10:
            out.append(elapsed)
    return out


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1)]


def measure(service: Service, probe: str, cursor: str, spec: dict[str, Any], n: int) -> dict[str, list[float]]:
    headers = {"Authorization": f"Bearer {service.api_key}"}
    with httpx.Client(base_url=service.url, headers=headers, timeout=60) as client:
        return {
            "GET /v1/jobs (first page)": timed(client, "GET", "/v1/jobs?limit=50", 200, n),
            "GET /v1/jobs (deep keyset page)": timed(client, "GET", f"/v1/jobs?limit=50&cursor={cursor}", 200, n),
            "GET /v1/jobs/{id}": timed(client, "GET", f"/v1/jobs/{probe}", 200, n),
            "GET /v1/jobs/{id}/metrics": timed(client, "GET", f"/v1/jobs/{probe}/metrics?limit=1000", 200, n),
            "GET /metrics (Prometheus)": timed(client, "GET", "/metrics", 200, max(20, n // 4)),
            "POST /v1/jobs": timed(client, "POST", "/v1/jobs", 201, n, spec),
        }


def time_gc(database_url: str, artifacts_root: str) -> str:
    from sqlalchemy.orm import sessionmaker

    from service_core.artifacts import ArtifactStore
    from service_core.db.session import make_engine
    from service_core.retention import collect_garbage

    engine = make_engine(database_url)
    started = time.perf_counter()
    report = collect_garbage(sessionmaker(bind=engine), timedelta(days=360), artifacts=ArtifactStore(artifacts_root))
    seconds = time.perf_counter() - started
    engine.dispose()
    rows = report.metric_points + report.events + report.jobs
    return (f"gc --older-than 360d: {report.jobs} jobs, {report.metric_points} points in {report.batches} "
            f"transactions, {seconds:.1f} s ({rows / max(seconds, 1e-9):,.0f} rows/s, "
            f"{seconds / max(report.batches, 1) * 1e3:.1f} ms per transaction on average)")  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--jobs", type=int, default=100_000, help="jobs in the large history")
    p.add_argument("--points", type=int, default=10_000_000, help="metric points in the large history")
    p.add_argument("--small-jobs", type=int, default=1_000)
    p.add_argument("--requests", type=int, default=200, help="measured requests per endpoint")
    args = p.parse_args()
    rng = random.Random(0)
    with running_service(1) as service:
        dsn = pg_dsn(service.database_url)
        with psycopg.connect(dsn) as conn:
            caller = conn.execute("SELECT owner FROM api_keys LIMIT 1").fetchone()[0]  # type: ignore[index]
        files = write_csv(service.data_root / "bench", rows=64)
        spec = {"name": "bench-submit", "task": "text-classification", "model": {"name_or_path": "bert-base-uncased"},
                "dataset": {"path": "csv", "data_files": files, "text_column": "text", "label_column": "label"},
                "queue": f"bench-unconsumed-{uuid.uuid4().hex[:8]}"}  # fmt: skip
        started = time.perf_counter()
        small_points = args.small_jobs * POINTS_PER_JOB
        ids = seed(dsn, 0, args.small_jobs, small_points, caller, rng)
        print(f"seeded {args.small_jobs} jobs / {small_points:,} points in {time.perf_counter() - started:.1f} s",
              flush=True)  # fmt: skip
        probe = ids[0]  # the caller's, 100 points
        small = measure(service, probe, deep_cursor(dsn, caller), spec, args.requests)
        started = time.perf_counter()
        seed(dsn, args.small_jobs, args.jobs - args.small_jobs, args.points - small_points, caller, rng)
        print(f"seeded up to {args.jobs:,} jobs / {args.points:,} points in {time.perf_counter() - started:.1f} s",
              flush=True)  # fmt: skip
        large = measure(service, probe, deep_cursor(dsn, caller), spec, args.requests)
        gc_line = time_gc(service.database_url, str(service.home / "artifacts"))
    ok = True
    print(f"\n{'endpoint':34} {'p50 small':>10} {'p99 small':>10} {'p50 large':>10} {'p99 large':>10} "
          f"{'p99 growth':>11}  goal <= {GOAL}x")  # fmt: skip
    for name in small:
        growth = pct(large[name], 0.99) / pct(small[name], 0.99)
        ok &= growth <= GOAL
        print(f"{name:34} {pct(small[name], 0.5) * 1e3:8.1f}ms {pct(small[name], 0.99) * 1e3:8.1f}ms "
              f"{pct(large[name], 0.5) * 1e3:8.1f}ms {pct(large[name], 0.99) * 1e3:8.1f}ms {growth:10.2f}x  "
              f"{'PASS' if growth <= GOAL else 'MISS'}")  # fmt: skip
    print(f"small: {args.small_jobs:,} jobs / {small_points:,} points; large: {args.jobs:,} jobs / {args.points:,} "
          f"points; {args.requests} requests per endpoint, sequential, keep-alive\n{gc_line}")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
