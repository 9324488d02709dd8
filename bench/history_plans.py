"""The query plans behind ``bench_history.py``'s rows: EXPLAIN (ANALYZE, BUFFERS) of the SQL each
measured request runs, at the small and the large history, so a row's growth (or flatness) is explained
by what the database read, not guessed.

Each statement is a copy of what the route sends (the file is named beside it). It is PREPAREd and run
twice, once under ``plan_cache_mode = force_custom_plan`` and once under ``force_generic_plan``: psycopg
prepares a statement on its fifth execution, after which PostgreSQL may switch to the generic plan,
which cannot see the parameter values (``status = $2`` looks like half the table, not the few queued
jobs). A plan whose pages read (buffers) grow with the history is what makes a p99 grow.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.sql import Literal

# (request, SQL with $n parameters, names of the parameters in order)
QUERIES: list[tuple[str, str, tuple[str, ...]]] = [
    # api/routes/jobs.py list_jobs (the key's owner; spec is deferred but the row is read from the heap)
    ("GET /v1/jobs (first page)",
     "SELECT id, owner, name, status, created_at FROM jobs WHERE owner = $1 ORDER BY created_at DESC, id DESC "
     "LIMIT 51", ("owner",)),
    ("GET /v1/jobs (deep keyset page)",
     "SELECT id, owner, name, status, created_at FROM jobs WHERE owner = $1 AND (created_at, id) < ($2, $3) "
     "ORDER BY created_at DESC, id DESC LIMIT 51", ("owner", "cursor_created_at", "cursor_id")),
    # api/deps.py OwnedJob and api/routes/jobs.py get_job (its retry events)
    ("GET /v1/jobs/{id}", "SELECT * FROM jobs WHERE id = $1", ("probe",)),
    ("GET /v1/jobs/{id} (retries)",
     "SELECT data FROM job_events WHERE job_id = $1 AND kind = $2 ORDER BY seq", ("probe", "retry")),
    # api/routes/metrics.py job_metrics, and thinned_page's pass 1 (every point of the series)
    ("GET /v1/jobs/{id}/metrics",
     "SELECT * FROM metric_points WHERE job_id = $1 AND seq > $2 ORDER BY seq, name LIMIT 1001", ("probe", "zero")),
    ("GET /v1/jobs/{id}/metrics (downsampled)",
     "SELECT name, seq, value FROM metric_points WHERE job_id = $1 AND seq > $2 ORDER BY seq", ("long", "zero")),
    # api/routes/prometheus.py JobsCollector
    ("GET /metrics (live jobs)",
     "SELECT status, queue, worker, count(*) FROM jobs WHERE status IN ($1, $2) GROUP BY status, queue, worker",
     ("queued", "running")),
    ("GET /metrics (totals)", "SELECT key, value FROM job_totals", ()),
    # api/quotas.py check_queued_quota (every submit)
    ("POST /v1/jobs (queued quota)",
     "SELECT count(*) FROM jobs WHERE owner = $1 AND status = $2", ("owner", "queued")),
]  # fmt: skip


@dataclass
class Plan:
    text: str
    buffers: int  # shared pages hit + read by the whole statement
    ms: float
    nodes: str  # the scans, e.g. "Index Scan ix_jobs_owner_created"


def explain(conn: psycopg.Connection[Any], sql: str, args: list[Any], mode: str) -> Plan:
    conn.execute(f"SET plan_cache_mode = {mode}")
    conn.execute(f"PREPARE q AS {sql}")
    # EXPLAIN EXECUTE takes no bound parameters: the values go in as literals.
    literals = ", ".join(Literal(arg).as_string(conn) for arg in args)
    execute = f"EXECUTE q({literals})" if args else "EXECUTE q"
    rows = conn.execute(f"EXPLAIN (ANALYZE, BUFFERS) {execute}").fetchall()  # type: ignore[call-overload]
    conn.execute("DEALLOCATE q")
    text = "\n".join(row[0] for row in rows)
    first_buffers = re.search(r"Buffers: shared (?:hit=(\d+))?\s*(?:read=(\d+))?", text)
    buffers = sum(int(g) for g in first_buffers.groups() if g) if first_buffers else 0
    ms = float(m.group(1)) if (m := re.search(r"Execution Time: ([\d.]+) ms", text)) else float("nan")
    scans = re.findall(r"((?:Parallel )?(?:Seq Scan|Index Only Scan|Index Scan|Bitmap Index Scan)"
                       r"(?: Backward)?(?: using (\w+))?(?: on (\w+))?)", text)  # fmt: skip
    nodes = ", ".join(dict.fromkeys(s[0].replace(" using", "").replace(" on", " on") for s in scans))
    return Plan(text, buffers, ms, nodes)


def explain_all(dsn: str, params: dict[str, Any]) -> dict[tuple[str, str], Plan]:
    """Every query under both plan cache modes: {(request, "custom" | "generic"): plan}."""
    out: dict[tuple[str, str], Plan] = {}
    with psycopg.connect(dsn, autocommit=True, prepare_threshold=None) as conn:
        for name, sql, arg_names in QUERIES:
            args = [params[a] for a in arg_names]
            for mode in ("custom", "generic"):
                explain(conn, sql, args, f"force_{mode}_plan")  # once to warm the cache, as a served request is
                out[(name, mode)] = explain(conn, sql, args, f"force_{mode}_plan")
    return out


def report(small: dict[tuple[str, str], Plan], large: dict[tuple[str, str], Plan]) -> str:
    """One line per query and mode (scans, pages read small -> large), then the large plans in full."""
    header = f"{'pages small':>11} {'pages large':>11} {'ms small':>9} {'ms large':>9}  scans at large"
    lines = [f"\n{'query (plan mode)':48} {header}"]
    for key, plan in large.items():
        before = small[key]
        lines.append(f"{key[0] + ' (' + key[1] + ')':48} {before.buffers:11d} {plan.buffers:11d} {before.ms:9.3f} "
                     f"{plan.ms:9.3f}  {plan.nodes}")  # fmt: skip
    lines.append("\nEXPLAIN (ANALYZE, BUFFERS) at the large history:")
    for (name, mode), plan in large.items():
        lines.append(f"-- {name} ({mode} plan)\n{plan.text}")
    return "\n".join(lines)
