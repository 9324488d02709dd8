"""Chaos bench (issue 12): break real processes under real jobs and count what was lost.

It starts the service (``trainjobs serve`` and two ``python -m worker.main`` workers) in two shapes,
``embedded`` (SQLite + the embedded broker) and ``production`` (a fresh PostgreSQL database behind a
TCP proxy the bench cuts, and a ``redis-server --appendonly yes`` of its own), submits tiny
config-built BERT runs (loss logged every step) and injects the faults of issue 12:

R1 SIGKILL the run / the slot / the worker main mid-training   R2 one message delivered twice, raced
R3 Redis (AOF) and API restarted with jobs queued, DB blocked 10 s (embedded: API, workers)   R4 cancels
R6 SIGSTOP a slot past its lease   R7 database unreachable during runs   R8 stale terminal writes
R9 many tiny jobs, random kills    R10 SIGKILL / SIGHUP ``trainjobs dev``

It prints one table (scenario, shape, trials, lost, duplicated, wrong final status, max recovery time)
and exits 1 on any loss, duplicate or wrong status. R6 and R8 need heartbeat leases and fencing
(``TRAINJOBS_LEASE_SECONDS``); without them they print ``blocked: needs leases`` and count as not run,
not as passed. Every scenario runs on both shapes, except R7 (an outage of a database server: the
embedded SQLite has none, its row says n/a); on embedded, R3 restarts the API and the workers (the
embedded broker's consumers) with jobs queued, production also Redis, and blocks PostgreSQL.
``--short`` is the suite's form (a trial or two each).

    .venv/bin/python bench/chaos.py [--short] [--scenarios R1,R4] [--shapes embedded,production] [--trials N]
                                    [--counts R1=5,R3=20,R9=60/20]

Each scenario's row is also logged (stderr) as it finishes, so a run stopped early still says what ran.
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from types import FrameType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: import bench.* and the packages

from bench.chaos_checks import Row, render
from bench.chaos_outages import r3_finish, r3_queue_and_restart, r6_r8_stale_slot, r7_db_outages, r10_launcher
from bench.chaos_scenarios import r1_kills, r2_double_delivery, r4_cancels, r9_storm
from bench.chaos_service import LIVE, Service
from service_core.settings import Settings

ALL = ["R1", "R2", "R3", "R4", "R6", "R7", "R8", "R9", "R10"]
SHAPES = ["embedded", "production"]
LEASE_ENV = "TRAINJOBS_LEASE_SECONDS"
# With leases: short ones, so a frozen or dead slot is noticed within seconds (the bench's clock).
LEASE_SETTINGS = {LEASE_ENV: "8", "TRAINJOBS_LEASE_RENEW_SECONDS": "2", "TRAINJOBS_SWEEP_SECONDS": "3"}


@dataclass(frozen=True)
class Plan:
    """Trials per shape; 0 (or absent) skips the scenario on that shape."""

    r1: dict[str, int]
    r2: dict[str, int]
    r3: dict[str, int]  # jobs queued through the restarts
    r4: dict[str, int]
    r6: dict[str, int]
    r7: list[float]  # outage lengths, s (production only: SQLite has no server to cut)
    r9: dict[str, tuple[int, int]]  # shape -> (jobs, kills)
    r10: dict[str, int]


# The suite's form: every scenario on both shapes, a trial or two each; R1's kinds of kill split over the
# shapes (the run and the slot on embedded; the worker main, restarted or, with leases, not, on production).
R1_FIRST = {"embedded": 0, "production": 2}
SHORT = Plan(r1={"embedded": 2, "production": 2}, r2={"embedded": 1, "production": 1},
             r3={"embedded": 2, "production": 2}, r4={"embedded": 2, "production": 2},
             r6={"embedded": 1, "production": 1}, r7=[5.0], r9={"embedded": (4, 2), "production": (4, 2)},
             r10={"embedded": 2, "production": 2})  # fmt: skip
LONG = Plan(r1={"embedded": 5, "production": 20}, r2={"embedded": 20, "production": 20},
            r3={"embedded": 100, "production": 100}, r4={"embedded": 20, "production": 20},
            r6={"embedded": 3, "production": 3}, r7=[5.0, 60.0],
            r9={"embedded": (100, 30), "production": (500, 100)}, r10={"embedded": 4, "production": 4})  # fmt: skip
# Shown instead of a row where a scenario cannot mean anything on a shape.
NOT_APPLICABLE = {("R7", "embedded"): "n/a: SQLite is a file opened in-process, no database server to cut"}


def with_trials(plan: Plan, n: int) -> Plan:
    """``plan`` with every trial count set to ``n`` (R9: ``n`` jobs, ``n // 3`` kills; R3: ``n`` queued)."""
    each = {shape: n for shape in SHAPES}
    return replace(plan, r1=each, r2=each, r3=each, r4=each, r6=each,
                   r9={shape: (n, max(1, n // 3)) for shape in SHAPES}, r10=each)  # fmt: skip


def with_counts(plan: Plan, counts: str) -> Plan:
    """``plan`` with some trial counts set on both shapes: ``R1=5,R3=20,R9=60/20`` (R9: jobs/kills)."""
    changes: dict[str, object] = {}
    for item in filter(None, (part.strip() for part in counts.split(","))):
        name, _, value = item.partition("=")
        key = name.strip().lower()
        if key == "r9":
            jobs, _, kills = value.partition("/")
            changes[key] = {shape: (int(jobs), int(kills or max(1, int(jobs) // 3))) for shape in SHAPES}
        elif key in ("r1", "r2", "r3", "r4", "r6", "r10"):
            changes[key] = {shape: int(value) for shape in SHAPES}
        else:
            raise ValueError(f"--counts: no trial count for {name!r}")
    return replace(plan, **changes)  # type: ignore[arg-type]


def has_leases() -> bool:
    """Whether the code under test has heartbeat leases (the setting exists)."""
    return any(info.validation_alias == LEASE_ENV for info in Settings.model_fields.values())


def run_shape(shape: str, wanted: list[str], plan: Plan, leases: bool) -> list[Row]:
    """Every wanted scenario that runs on a live service of ``shape``, on one service."""
    rows: list[Row] = []
    service_scenarios = [s for s in wanted if s != "R10" and (s, shape) not in NOT_APPLICABLE]
    if not service_scenarios:
        return rows
    started = time.monotonic()
    svc = Service(shape, LEASE_SETTINGS if leases else {})
    try:
        r3_ids: list[str] = []
        try:
            svc.start_api()
            if "R3" in wanted and plan.r3.get(shape):  # queued while no worker consumes
                r3_ids = r3_queue_and_restart(svc, plan.r3[shape])
            for _ in range(2):
                svc.start_worker(wait=False)
            svc.wait_workers_ready()
        except Exception as exc:  # the shape could not start: every scenario of it failed
            return [failed(name, shape, f"service start: {exc}") for name in service_scenarios]
        log(f"{shape}: service up in {time.monotonic() - started:.0f} s")
        steps: list[tuple[str, object, Callable[[], list[Row]]]] = [
            ("R3", r3_ids, lambda: [r3_finish(svc, r3_ids)]),
            ("R2", plan.r2.get(shape), lambda: [r2_double_delivery(svc, plan.r2[shape])]),
            ("R1", plan.r1.get(shape), lambda: [r1_kills(svc, plan.r1[shape], leases, R1_FIRST[shape])]),
            ("R4", plan.r4.get(shape), lambda: [r4_cancels(svc, plan.r4[shape])]),
            ("R9", plan.r9.get(shape), lambda: [r9_storm(svc, *plan.r9[shape])]),
            ("R6", leases and plan.r6.get(shape), lambda: list(r6_r8_stale_slot(svc, plan.r6[shape]))),
        ]
        if shape == "production":
            steps.append(("R7", plan.r7, lambda: [r7_db_outages(svc, plan.r7)]))
        for name, planned, step in steps:
            if planned and (name in wanted or (name == "R6" and "R8" in wanted)):
                t0 = time.monotonic()
                try:
                    got = step()
                except Exception as exc:  # a scenario that crashed counts as failed, the others still run
                    log(f"{shape}: {name} crashed:\n{traceback.format_exc()}")
                    got = [failed(name, shape, f"crashed: {type(exc).__name__}: {exc}")]
                rows.extend(r for r in got if r.scenario in wanted)
                log(f"{shape}: {name} row(s):\n{render([r for r in got if r.scenario in wanted])}")
                log(f"{shape}: {name} done in {time.monotonic() - t0:.0f} s")
    finally:
        svc.close()
    return rows


def launcher_rows(plan: Plan, shape: str) -> list[Row]:
    return [r10_launcher(plan.r10[shape], shape)]


def failed(name: str, shape: str, why: str) -> Row:
    row = Row(name, shape)
    row.fail(why)
    return row


def log(message: str) -> None:
    print(f"[chaos {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", action="store_true", help="a few trials each (the suite's form)")
    parser.add_argument("--scenarios", default=",".join(ALL), help="comma-separated ids, e.g. R1,R4")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="embedded, production or both")
    parser.add_argument("--trials", type=int, default=0, help="override every trial count (R9: jobs)")
    parser.add_argument("--counts", default="", help="override some trial counts, e.g. R1=5,R3=20,R9=60/20")
    args = parser.parse_args()
    wanted = [s.strip().upper() for s in args.scenarios.split(",") if s.strip()]
    shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    if unknown := sorted(set(wanted) - set(ALL)) + sorted(set(shapes) - set(SHAPES)):
        parser.error(f"unknown scenario or shape: {', '.join(unknown)}")
    plan = SHORT if args.short else LONG
    if args.trials > 0:
        plan = with_trials(plan, args.trials)
    if args.counts:
        try:
            plan = with_counts(plan, args.counts)
        except ValueError as exc:
            parser.error(str(exc))

    def interrupted(signum: int, _frame: FrameType | None) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupted)  # clean up on SIGTERM as on Ctrl-C
    leases = has_leases()
    started = time.monotonic()
    # The shapes (and the launcher scenario) are independent: run side by side, the wall time is the longest.
    parts: list[Callable[[], list[Row]]] = [partial(run_shape, shape, wanted, plan, leases) for shape in shapes]
    if "R10" in wanted:
        parts += [partial(launcher_rows, plan, shape) for shape in shapes if plan.r10.get(shape)]
    rows: list[Row] = []
    pool = ThreadPoolExecutor(len(parts))
    try:
        for future in [pool.submit(part) for part in parts]:
            rows += future.result()
    except KeyboardInterrupt:
        for svc in list(LIVE):
            svc.close()
        raise
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    if not leases:
        rows += [Row(s, shape, note="blocked: needs leases (not run)", blocked=True)
                 for s in ("R6", "R8") if s in wanted for shape in shapes]  # fmt: skip
    rows += [Row(s, shape, note=why, blocked=True, applicable=False)
             for (s, shape), why in NOT_APPLICABLE.items() if s in wanted and shape in shapes]  # fmt: skip
    rows.sort(key=lambda r: (ALL.index(r.scenario), SHAPES.index(r.shape)))
    form = ("short" if args.short else "long") + (f", {args.trials} trials each" if args.trials else "")
    form += f", counts {args.counts}" if args.counts else ""
    print(f"chaos bench ({form} form), {time.monotonic() - started:.0f} s; every scenario on both shapes except "
          "R7 (production only); R3 on embedded restarts the API and the workers, not Redis or PostgreSQL")  # fmt: skip
    print(render(rows))
    not_run = sorted({r.scenario for r in rows if r.blocked and r.applicable})
    if not_run:
        print(f"not run: {', '.join(not_run)}")
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
