"""Preflight's share of a submit (issue 10), measured for ``bench_api.py`` (``--only preflight`` runs just this).

On the example data (``trainer_core/../trainjobs/examples`` CSVs and the packaged MiniLM, placed as
``trainjobs dev --example`` places them) and on generated 10 MB and 100 MB CSVs (the example's columns,
under the service's data root):

- ``trainer_core.preflight.preflight(spec)`` in this process, ``--preflight-runs`` times each: the time
  a submit spends in it (the API runs the same call synchronously, in a thread, before storing);
- over HTTP, one client at a time (latency, not queueing): ``POST /v1/jobs`` (preflight included, to a
  queue no worker consumes) and ``POST /v1/jobs?dry_run=true`` (preflight and estimate, nothing stored).
  The submit without preflight is that submit minus the in-process preflight p50 (derived: the API
  has no switch to skip it).

Goals: preflight adds at most 20 ms p50 to a submit on the example data; its work is bounded on big
files: ten times the file (10 MB -> 100 MB) costs at most 1.5 times the time (p50), and one preflight
of the 100 MB file reads at most 5 MB ("a few MB", the issue's bound; bytes counted by the kernel in
``/proc/self/io`` ``rchar``, so noise on a shared machine cannot move it; it includes the model's config
and tokenizer files). Tail latencies (p99) are printed, not judged: on a loaded 2-core box they are the
neighbours' doing.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from bench_api import percentile

from service_core.settings import Settings
from trainer_core.preflight import preflight
from trainer_core.spec import JobSpec
from trainjobs.launcher import write_example

GOAL_ADDED_P50_MS, BIG_GROWTH_MAX, BIG_READ_MAX_MB = 20.0, 1.5, 5.0
LINE_WORDS = ["great", "lovely", "superb", "fun", "awful", "dull", "poor", "sad", "plot", "cast"]


@dataclass
class Timing:
    name: str
    latencies: list[float]
    bytes_read: int | None = None

    def ms(self, q: float) -> float:
        return percentile(self.latencies, q) * 1e3


def example_spec(home: Path) -> dict[str, Any]:
    """The example job with its real paths, written by the same code as ``trainjobs dev --example``."""
    settings = Settings.model_validate({"TRAINJOBS_HOME": str(home)})
    spec: dict[str, Any] = json.loads(write_example(settings).read_text())
    return spec


def write_big_csv(path: Path, megabytes: int) -> Path:
    """A two-class CSV of about ``megabytes`` MB with the example's columns (text, label)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f'"the film was {LINE_WORDS[i % 10]} and the {LINE_WORDS[(i * 7) % 10]} row {i}",'
             f"{'positive' if i % 2 else 'negative'}\n" for i in range(10_000)]  # fmt: skip
    block = "".join(lines).encode()
    with path.open("wb") as fh:
        fh.write(b"text,label\n")
        for _ in range(max(1, megabytes * 1_000_000 // len(block))):
            fh.write(block)
    return path


def with_train_file(spec: dict[str, Any], train: Path) -> dict[str, Any]:
    dataset = {**spec["dataset"], "data_files": {**spec["dataset"]["data_files"], "train": str(train)}}
    return {**spec, "dataset": dataset}


def bytes_read() -> int:
    """Bytes this process has read so far (read syscalls, page cache included): Linux ``rchar``."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("no rchar in /proc/self/io")


def time_preflight(name: str, spec: dict[str, Any], runs: int) -> Timing:
    """``preflight(spec)`` ``runs`` times after one warm-up call (imports, first reads)."""
    parsed = JobSpec.model_validate(spec)
    preflight(parsed)
    before = bytes_read()
    preflight(parsed)
    read = bytes_read() - before
    latencies = []
    for _ in range(runs):
        t0 = time.perf_counter()
        preflight(parsed)
        latencies.append(time.perf_counter() - t0)
    return Timing(name, latencies, read)


def time_posts(url: str, api_key: str, name: str, body: dict[str, Any], runs: int, dry_run: bool) -> Timing:
    """``runs`` sequential POST /v1/jobs (one client: each latency is the service's, not a queue's)."""
    params = {"dry_run": "true"} if dry_run else None
    latencies = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {api_key}"}, timeout=30) as client:
        for i in range(runs + 5):  # the first five warm the connection and the API process
            t0 = time.perf_counter()
            answer = client.post("/v1/jobs", json=body, params=params)
            elapsed = time.perf_counter() - t0
            if answer.status_code != (200 if dry_run else 201):
                raise RuntimeError(f"{name}: {answer.status_code} {answer.text[:500]}")
            if i >= 5:
                latencies.append(elapsed)
    return Timing(name, latencies)


def measure_preflight(url: str, api_key: str, home: Path, data_root: Path, runs: int) -> list[Timing]:
    """In-process preflight on the example, 10 MB and 100 MB; then HTTP submits and dry runs beside them."""
    spec = example_spec(home)
    big = {mb: write_big_csv(data_root / "bench-big" / f"train-{mb}mb.csv", mb) for mb in (10, 100)}
    timings = [
        time_preflight("preflight, example", spec, runs),
        time_preflight("preflight, 10 MB CSV", with_train_file(spec, big[10]), runs),
        time_preflight("preflight, 100 MB CSV", with_train_file(spec, big[100]), runs),
    ]
    body = {**spec, "queue": f"bench-unconsumed-{uuid.uuid4().hex[:8]}"}  # no worker: nothing trains
    http_runs = max(20, runs // 2)
    timings += [
        time_posts(url, api_key, "POST /v1/jobs, example", body, http_runs, dry_run=False),
        time_posts(url, api_key, "POST ?dry_run=true, example", body, http_runs, dry_run=True),
        time_posts(url, api_key, "POST ?dry_run=true, 100 MB", with_train_file(body, big[100]), http_runs, True),
    ]
    return timings


def report_preflight(timings: list[Timing]) -> bool:
    """Print the figures and the goals; True when both are met."""
    by_name = {t.name: t for t in timings}
    example, mid, big = (by_name[f"preflight, {n}"] for n in ("example", "10 MB CSV", "100 MB CSV"))
    submit = by_name["POST /v1/jobs, example"]
    print(f"\n{'preflight (issue 10)':<34}{'runs':>6}{'p50 ms':>9}{'p99 ms':>9}{'MB read':>9}")
    for timing in timings:
        read = f"{timing.bytes_read / 1e6:>9.2f}" if timing.bytes_read is not None else ""
        print(f"{timing.name:<34}{len(timing.latencies):>6}{timing.ms(50):>9.1f}{timing.ms(99):>9.1f}{read}")
    without = submit.ms(50) - example.ms(50)
    print(f"{'POST /v1/jobs without preflight':<34}{'':>6}{without:>9.1f}{'':>9}   (derived: submit - preflight)")
    growth = big.ms(50) / mid.ms(50)
    goals = [
        (f"preflight adds <= {GOAL_ADDED_P50_MS:.0f} ms p50 (example)", f"{example.ms(50):.1f} ms",
         example.ms(50) <= GOAL_ADDED_P50_MS),
        (f"bounded: 10x file -> <= {BIG_GROWTH_MAX}x time", f"{growth:.2f}x", growth <= BIG_GROWTH_MAX),
        (f"bounded: 100 MB file, <= {BIG_READ_MAX_MB:.0f} MB read", f"{(big.bytes_read or 0) / 1e6:.2f} MB",
         big.bytes_read is not None and big.bytes_read <= BIG_READ_MAX_MB * 1e6),
    ]  # fmt: skip
    print(f"\n{'goal':<44}{'measured':>12}  result")
    for goal, measured, met in goals:
        print(f"{goal:<44}{measured:>12}  {'PASS' if met else 'MISS'}")
    return all(met for _, _, met in goals)
