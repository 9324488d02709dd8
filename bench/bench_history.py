"""Long history: API latency with 1,000 jobs / 100,000 metric points against 100,000 jobs / 10 million.

    .venv/bin/python bench/bench_history.py [--jobs 100000] [--points 10000000] [--requests 200]

Needs PostgreSQL and Redis (``bench_api.running_service``: a fresh database, the API under ``trainjobs
serve``). It seeds the small history with COPY, measures, grows the same database to the large
history, measures again, and prints per endpoint p50/p99 small and large and the growth of the p99
(goal: <= 1.2x, PASS/MISS):

- ``GET /v1/jobs`` first page and a deep keyset page (a cursor 90% of the way down the caller's jobs);
- ``GET /v1/jobs/{id}`` and ``GET /v1/jobs/{id}/metrics`` of one job with 100 points;
- ``GET /v1/jobs/{id}/metrics?max_points=500``: the dashboard's downsampled chart of one 10,000-point run;
- ``GET /metrics`` (Prometheus);
- ``POST /v1/jobs`` (to a queue no worker consumes).

Half the jobs belong to the caller, half to 99 other owners; creation times spread over a year, points
are 100 per job. The seeder COPYs with the points' foreign-key trigger off and, for the large history,
the points' secondary indexes dropped and rebuilt afterwards (one sort instead of 10 million index
insertions). After each measurement the SQL of every row is EXPLAINed (``history_plans.py``): pages read
small against large, and the large plans in full. Finally ``trainjobs gc --older-than 90d``'s work
(``service_core.retention``) runs on the large history, timed.
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
from history_plans import explain_all, report

GOAL = 1.2
POINTS_PER_JOB = 100
LONG_RUN_POINTS = 10_000  # the downsampled chart's run
NOW = datetime.now(UTC)
SPEC = json.dumps({"name": "seeded", "task": "text-classification", "model": {"name_or_path": "bert-base-uncased"},
                   "dataset": {"path": "csv"}})  # fmt: skip


def pg_dsn(url: str) -> str:
    return url.replace("postgresql+psycopg://", "postgresql://")


def seed(dsn: str, first: int, jobs: int, points: int, caller: str, rng: random.Random,
         rebuild_indexes: bool = False) -> list[str]:  # fmt: skip
    """Jobs ``first``..``first+jobs-1`` and ``points`` metric points spread over them, with COPY."""
    ids = [f"{i:032x}" for i in range(first, first + jobs)]
    per_job = max(1, points // jobs)
    finished: dict[str, int] = {}
    with psycopg.connect(dsn) as conn, conn.cursor() as cur:
        # The seeder writes points of its own jobs only: no need for a foreign-key check per point.
        conn.execute("SET session_replication_role = replica")
        conn.execute("SET maintenance_work_mem = '256MB'")
        with cur.copy("COPY jobs (id, owner, name, status, queue, priority, spec, created_at, updated_at, "
                      "started_at, finished_at, progress_step, attempts, cancel_requested, last_seq) "
                      "FROM STDIN") as copy:  # fmt: skip
            buf = io.StringIO()
            for i, job_id in enumerate(ids):
                owner = caller if i % 2 == 0 else f"user{i % 99}"
                created = NOW - timedelta(seconds=rng.uniform(0, 365 * 86400))
                ended = created + timedelta(seconds=rng.uniform(30, 3600))
                status = "failed" if i % 10 == 0 else "succeeded"
                finished[status] = finished.get(status, 0) + 1
                buf.write(f"{job_id}\t{owner}\tjob-{i}\t{status}\tdefault\t0\t{SPEC}\t{created.isoformat()}\t"
                          f"{ended.isoformat()}\t{created.isoformat()}\t{ended.isoformat()}\t{per_job}\t1\tf\t"
                          f"{per_job}\n")  # fmt: skip
            copy.write(buf.getvalue())
        # The running totals /metrics reads (the service adds to them as jobs finish; seeded jobs skip that).
        cur.executemany("INSERT INTO job_totals (key, value) VALUES (%s, %s) ON CONFLICT (key) DO UPDATE "
                        "SET value = job_totals.value + excluded.value",
                        [(f"finished:{status}", count) for status, count in sorted(finished.items())])  # fmt: skip
        rebuilt = drop_secondary_indexes(cur, "metric_points") if rebuild_indexes else []
        copy_points(cur, ids, per_job)
        for statement in rebuilt:
            cur.execute(statement)
        conn.commit()
        conn.execute("ANALYZE jobs")
        conn.execute("ANALYZE metric_points")
    return ids


def copy_points(cur: psycopg.Cursor[Any], ids: list[str], per_job: int) -> None:
    """``per_job`` loss points for each job, in (job, seq) order, a few MB of text per write."""
    stamp = NOW.isoformat()
    lines = [f"\t{s + 1}\t{s + 1}\tloss\t{1.0 / (s + 1):.6f}\t{stamp}\n" for s in range(per_job)]
    with cur.copy("COPY metric_points (job_id, seq, step, name, value, time) FROM STDIN") as copy:
        chunk = 50_000 // per_job + 1
        for start in range(0, len(ids), chunk):
            copy.write("".join(job_id + line for job_id in ids[start : start + chunk] for line in lines))


def drop_secondary_indexes(cur: psycopg.Cursor[Any], table: str) -> list[str]:
    """Drop ``table``'s indexes other than its primary key; returns the statements that recreate them."""
    constraints = cur.execute(
        "SELECT conname, pg_get_constraintdef(oid) FROM pg_constraint WHERE conrelid = %s::regclass "
        "AND contype = 'u'", (table,)).fetchall()  # fmt: skip
    indexes = cur.execute(
        "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = %s AND indexname NOT IN "
        "(SELECT conname FROM pg_constraint WHERE conrelid = %s::regclass)", (table, table)).fetchall()  # fmt: skip
    for name, _ in constraints:
        cur.execute(f'ALTER TABLE {table} DROP CONSTRAINT "{name}"')
    for name, _ in indexes:
        cur.execute(f'DROP INDEX "{name}"')
    return [f'ALTER TABLE {table} ADD CONSTRAINT "{name}" {definition}' for name, definition in constraints] + [
        definition for _, definition in indexes
    ]


def seed_long_run(dsn: str, caller: str) -> str:
    """One of the caller's jobs with LONG_RUN_POINTS points: the chart the dashboard downsamples."""
    job_id = "f" * 32
    with psycopg.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute("INSERT INTO jobs (id, owner, name, status, queue, priority, spec, created_at, updated_at, "
                    "progress_step, attempts, cancel_requested, last_seq) VALUES (%s, %s, 'long-run', 'succeeded', "
                    "'default', 0, %s, now() - interval '400 days', now(), 0, 1, false, %s)",
                    (job_id, caller, SPEC, LONG_RUN_POINTS))  # fmt: skip
        conn.execute("SET session_replication_role = replica")
        copy_points(cur, [job_id], LONG_RUN_POINTS)
    return job_id


def deep_cursor(dsn: str, caller: str) -> tuple[str, datetime, str]:
    """The cursor of the job 90% of the way down the caller's list (newest first), and its key."""
    from api.schemas.jobs import Cursor

    with psycopg.connect(dsn) as conn:
        total = conn.execute("SELECT count(*) FROM jobs WHERE owner = %s", (caller,)).fetchone()[0]  # type: ignore[index]
        row = conn.execute("SELECT created_at, id FROM jobs WHERE owner = %s ORDER BY created_at DESC, id DESC "
                           "OFFSET %s LIMIT 1", (caller, int(total * 0.9))).fetchone()  # fmt: skip
    assert row is not None
    return Cursor(created_at=row[0], id=row[1]).encode(), row[0], row[1]


def finish_submitted(dsn: str, queue: str) -> None:
    """Cancel the jobs the submit row queued, so each measurement starts with no live jobs: the
    queued-jobs counts (``/metrics``, the submit quota) then see the history grow, not the bench's own
    submits pile up between the small and the large run."""
    with psycopg.connect(dsn) as conn:
        conn.execute("UPDATE jobs SET status = 'cancelled', finished_at = now() WHERE queue = %s "
                     "AND status = 'queued'", (queue,))  # fmt: skip


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


def measure(service: Service, probe: str, long_run: str, cursor: str, spec: dict[str, Any],
            n: int) -> dict[str, list[float]]:  # fmt: skip
    headers = {"Authorization": f"Bearer {service.api_key}"}
    with httpx.Client(base_url=service.url, headers=headers, timeout=60) as client:
        return {
            "GET /v1/jobs (first page)": timed(client, "GET", "/v1/jobs?limit=50", 200, n),
            "GET /v1/jobs (deep keyset page)": timed(client, "GET", f"/v1/jobs?limit=50&cursor={cursor}", 200, n),
            "GET /v1/jobs/{id}": timed(client, "GET", f"/v1/jobs/{probe}", 200, n),
            "GET /v1/jobs/{id}/metrics": timed(client, "GET", f"/v1/jobs/{probe}/metrics?limit=1000", 200, n),
            "GET .../metrics?max_points=500": timed(
                client, "GET", f"/v1/jobs/{long_run}/metrics?max_points=500", 200, n
            ),
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
    report = collect_garbage(sessionmaker(bind=engine), timedelta(days=90), artifacts=ArtifactStore(artifacts_root))
    seconds = time.perf_counter() - started
    engine.dispose()
    rows = report.metric_points + report.events + report.jobs
    return (f"gc --older-than 90d: {report.jobs} jobs, {report.metric_points} points in {report.batches} "
            f"transactions, {seconds:.1f} s ({rows / max(seconds, 1e-9):,.0f} rows/s, "
            f"{seconds / max(report.batches, 1) * 1e3:.1f} ms per transaction on average)")  # fmt: skip


def print_table(small: dict[str, list[float]], large: dict[str, list[float]], small_jobs: int, small_points: int,
                jobs: int, points: int, requests: int) -> bool:  # fmt: skip
    """Each row's p50/p99 at both sizes and the p99 growth against the goal; True when all pass."""
    ok = True
    print(f"\n{'endpoint':34} {'p50 small':>10} {'p99 small':>10} {'p50 large':>10} {'p99 large':>10} "
          f"{'p99 growth':>11}  goal <= {GOAL}x")  # fmt: skip
    for name in small:
        growth = pct(large[name], 0.99) / pct(small[name], 0.99)
        ok &= growth <= GOAL
        print(f"{name:34} {pct(small[name], 0.5) * 1e3:8.1f}ms {pct(small[name], 0.99) * 1e3:8.1f}ms "
              f"{pct(large[name], 0.5) * 1e3:8.1f}ms {pct(large[name], 0.99) * 1e3:8.1f}ms {growth:10.2f}x  "
              f"{'PASS' if growth <= GOAL else 'MISS'}")  # fmt: skip
    print(f"small: {small_jobs:,} jobs / {small_points:,} points; large: {jobs:,} jobs / {points:,} points (+ one "
          f"{LONG_RUN_POINTS:,}-point run in both); {requests} requests per endpoint, sequential, keep-alive",
          flush=True)  # fmt: skip
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--jobs", type=int, default=100_000, help="jobs in the large history")
    p.add_argument("--points", type=int, default=10_000_000, help="metric points in the large history")
    p.add_argument("--small-jobs", type=int, default=1_000)
    p.add_argument("--requests", type=int, default=200, help="measured requests per endpoint")
    p.add_argument("--no-gc", action="store_true", help="skip timing gc on the large history")
    args = p.parse_args()
    rng = random.Random(0)
    with running_service(1) as service:
        dsn = pg_dsn(service.database_url)
        with psycopg.connect(dsn) as conn:
            caller = conn.execute("SELECT owner FROM api_keys LIMIT 1").fetchone()[0]  # type: ignore[index]
        files = write_csv(service.data_root / "bench", rows=64)
        queue = f"bench-unconsumed-{uuid.uuid4().hex[:8]}"
        # Config-built BERT-base, as bench_api.py: submit's preflight refuses a hub id not in the cache offline.
        spec = {"name": "bench-submit", "task": "text-classification", "model": {"config": {"model_type": "bert"}},
                "dataset": {"path": "csv", "data_files": files, "text_column": "text", "label_column": "label"},
                "queue": queue}  # fmt: skip
        started = time.perf_counter()
        small_points = args.small_jobs * POINTS_PER_JOB
        ids = seed(dsn, 0, args.small_jobs, small_points, caller, rng)
        long_run = seed_long_run(dsn, caller)
        print(f"seeded {args.small_jobs} jobs / {small_points:,} points in {time.perf_counter() - started:.1f} s",
              flush=True)  # fmt: skip
        probe = ids[0]  # the caller's, 100 points
        cursor, cursor_at, cursor_id = deep_cursor(dsn, caller)
        small = measure(service, probe, long_run, cursor, spec, args.requests)
        finish_submitted(dsn, queue)
        params = {
            "owner": caller,
            "probe": probe,
            "long": long_run,
            "zero": 0,
            "queued": "queued",
            "running": "running",
            "retry": "retry",
            "cursor_created_at": cursor_at,
            "cursor_id": cursor_id,
        }
        small_plans = explain_all(dsn, params)
        started = time.perf_counter()
        seed(dsn, args.small_jobs, args.jobs - args.small_jobs, args.points - small_points, caller, rng,
             rebuild_indexes=True)  # fmt: skip
        print(f"seeded up to {args.jobs:,} jobs / {args.points:,} points in {time.perf_counter() - started:.1f} s",
              flush=True)  # fmt: skip
        cursor, cursor_at, cursor_id = deep_cursor(dsn, caller)
        large = measure(service, probe, long_run, cursor, spec, args.requests)
        finish_submitted(dsn, queue)
        large_plans = explain_all(dsn, {**params, "cursor_created_at": cursor_at, "cursor_id": cursor_id})
        print(report(small_plans, large_plans), flush=True)
        ok = print_table(small, large, args.small_jobs, small_points, args.jobs, args.points, args.requests)
        if not args.no_gc:  # after the table: on a busy machine gc of the large history takes a while
            print(time_gc(service.database_url, str(service.home / "artifacts")), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
