"""The chaos bench's short form (issue 12) in the suite, for the faults no other test injects: real
API and worker processes on the embedded and production shapes, nothing lost, duplicated or ending in
the wrong status.

One copy of each fault check: the scenarios that a dedicated test already injects, with sharper
assertions, are not run again here (``bench/chaos.py --short`` still runs them all):

- R1 (SIGKILL the run, the slot, the worker): tests/worker/test_restarts_and_outages.py (a killed run
  resumes), tests/trainjobs/test_dev_launcher.py (a stopped worker requeues),
  tests/fleet/test_host_loss.py (a host with its worker, slot and run gone);
- R2 (one message delivered twice): tests/worker/test_claim.py (a second claim loses, a redelivery of
  a running job is ignored) on SQLite and PostgreSQL, and test_lease_live.py (run once);
- R4 (cancels): tests/worker/test_service_e2e.py (queued, running and finished jobs);
- R6 and R8 (a frozen slot, its stale writes): tests/worker/test_lease_live.py (fenced out, the job
  ends once; on SQLite), tests/fleet/test_host_loss.py (the same for a host cut off, on PostgreSQL)
  and test_fencing.py (a stale attempt writes nothing);
- R7 (a database outage): tests/worker/test_restarts_and_outages.py (a run survives it and stores
  every event);
- R10 (the launcher killed): tests/trainjobs/test_lifecycle.py.

Left here: R3 (Redis and the API restarted with jobs queued) and R9 (a storm of tiny jobs with random
kills)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = ["R3", "R9"]
SHAPES = ["embedded", "production"]


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.timeout(900)
def test_the_short_chaos_bench_loses_nothing() -> None:
    bench = subprocess.run(
        [sys.executable, str(REPO / "bench" / "chaos.py"), "--short", "--scenarios", ",".join(SCENARIOS)],
        cwd=REPO, capture_output=True, text=True, timeout=900,
        check=False,
    )  # fmt: skip
    report = f"{bench.stdout}\n--- stderr (tail)\n{bench.stderr[-4000:]}"
    assert bench.returncode == 0, report
    lines = bench.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("scenario"))
    rows = [line.split() for line in lines[header + 2 :] if line[:1] == "R"]
    assert sorted((row[0], row[1]) for row in rows) == sorted((s, shape) for s in SCENARIOS for shape in SHAPES), report
    for row in rows:
        _scenario, _shape, trials, lost, duplicated, wrong = row[:6]
        assert int(trials) > 0 and (lost, duplicated, wrong) == ("0", "0", "0"), report
