"""Where the suite's CPU goes: run pytest while sampling every process on the machine.

    .venv/bin/python bench/suite_profile.py [--out profile.json] [--interval 0.3] [-- PYTEST ARGS]

PYTEST ARGS default to the Makefile's (``tests -n 3``). On the 2-core machine the suite keeps both
cores busy nearly to its end (issue 24), so its wall time is its CPU over two: to make it faster is to
make it do less. This says what does the work:

- the machine's busy share per minute (is there idle time left to fill?);
- CPU by kind of process: the xdist workers (the in-process tests), worker zygotes and the runs they
  fork, API processes, Celery slots, Chromium, CLI calls...;
- CPU of the processes each test module started: a process is charged to the test that was running,
  when it was first seen, on the xdist worker it descends from (a plugin this script loads logs which
  test runs where). Processes the suite's service parent forked (worker/service_parent.py) descend from
  it, not from a test, and are charged to none.

Every ``--interval`` seconds it reads each process's ``/proc/PID/stat`` (worker/procfs.py); a process's
CPU is its last reading (user + system, children not included), so a process that lives less than an
interval is missed, and one that ends between two readings loses at most an interval of CPU. Processes
already running when pytest starts are charged only what they use while it runs. The sampling itself
takes a few percent of one core.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from worker.procfs import all_processes, cmdline, machine_cpu_ticks  # noqa: E402

EVENTS_ENV = "SUITE_PROFILE_EVENTS"  # where the plugin (this module, loaded by pytest) logs
TICK = os.sysconf("SC_CLK_TCK")
# A process's kind by its command line; the first match wins (MLflow's server runs under uvicorn).
KINDS: tuple[tuple[str, str], ...] = (
    ("xdist worker (in-process tests)", r"exec\(eval\(sys\.stdin"),  # execnet's bootstrap
    ("worker zygote", r"worker\.zygote"),
    ("service parent and its keepers", r"worker\.service_parent"),
    ("MLflow", r"mlflow"),
    ("API process", r"trainjobs(\.cli)? serve|api\.main:create_app|trainjobs\.serving"),
    ("Celery slot", r"celery"),
    ("worker main", r"worker\.main|trainjobs(\.cli)? worker"),
    ("dev launcher", r"trainjobs(\.cli)? dev"),
    ("fresh trainer_core run", r"trainer_core"),
    ("bench script", r"bench/\w+\.py"),
    ("CLI call", r"trainjobs"),
    ("SeaweedFS", r"\bweed\b"),
    ("Chromium", r"chrom"),
    ("PostgreSQL", r"^postgres"),
    ("pip / uv", r"\bpip\b|\buv\b"),
)
FORKED_RUN = "run forked from a zygote"  # a zygote's child shows its parent's command line


@dataclass
class Seen:
    pid: int
    ppid: int
    started: int
    command: str
    first_seen: float
    cpu_s: float = 0.0  # used while sampled: for a process older than the run, only what it used since
    before: bool = False  # it was running when the run started (the database server, another job)


def kind_of(command: str) -> str:
    return next((kind for kind, pattern in KINDS if re.search(pattern, command)), "other")


class Sampler(threading.Thread):
    """Reads every process's CPU, and the machine's, until stopped."""

    def __init__(self, interval: float) -> None:
        super().__init__(daemon=True)
        self.interval, self.stopping = interval, threading.Event()
        self.seen: dict[tuple[int, int], Seen] = {}
        self.busy: list[tuple[float, float]] = []  # (time, busy share of all cores since the last reading)
        self.baseline = {(stat.pid, stat.started): stat.cpu_ticks for stat in all_processes()}

    def run(self) -> None:
        last, last_at = machine_cpu_ticks(), time.time()
        while not self.stopping.wait(self.interval):
            now = time.time()
            for stat in all_processes():
                key = (stat.pid, stat.started)
                if key not in self.seen:
                    command = cmdline(stat.pid).replace(b"\0", b" ").decode(errors="replace").strip()
                    self.seen[key] = Seen(stat.pid, stat.ppid, stat.started, command, now, before=key in self.baseline)
                self.seen[key].cpu_s = (stat.cpu_ticks - self.baseline.get(key, 0)) / TICK
            if now - last_at >= 1.0:
                busy, total = machine_cpu_ticks()
                self.busy.append((now, (busy - last[0]) / max(total - last[1], 1)))
                last, last_at = (busy, total), now


def summarize(seen: Iterable[Seen], events: list[dict[str, Any]]) -> dict[str, Any]:
    """CPU by kind of process and by test module, from the sampled processes and the plugin's events."""
    procs = [p for p in seen if not p.before or p.cpu_s > 0]
    by_pid = {p.pid: p for p in procs}  # pids reused within a run are rare; the latest one wins
    zygotes = {p.pid for p in procs if kind_of(p.command) == "worker zygote"}
    workers = {e["pid"]: e["worker"] for e in events if e["event"] == "worker"}
    starts: dict[str, list[tuple[float, str]]] = defaultdict(list)
    for e in events:
        if e["event"] == "start":
            starts[e["worker"]].append((e["time"], e["test"].split("::", 1)[0]))
    for runs in starts.values():
        runs.sort()

    def module_of(proc: Seen) -> str | None:
        pid = proc.ppid
        for _ in range(64):  # up the parents to the xdist worker (or serial pytest) it descends from
            if pid in workers:
                runs = starts[workers[pid]]
                at = bisect.bisect_right(runs, (proc.first_seen, "\uffff")) - 1
                return runs[at][1] if at >= 0 else "(collection)"
            parent = by_pid.get(pid)
            if parent is None:
                return None
            pid = parent.ppid
        return None

    kind_count: Counter[str] = Counter()
    kind_cpu: dict[str, float] = defaultdict(float)
    modules: dict[str, Counter[str]] = defaultdict(Counter)
    module_cpu: dict[str, float] = defaultdict(float)
    for proc in procs:
        kind = FORKED_RUN if proc.ppid in zygotes else kind_of(proc.command)
        kind_count[kind] += 1
        kind_cpu[kind] += proc.cpu_s
        module = None if proc.pid in workers else module_of(proc)
        if module is not None:
            modules[module][kind] += 1
            module_cpu[module] += proc.cpu_s
    heaviest = sorted(module_cpu.items(), key=lambda item: -item[1])
    return {
        "cpu_s": sum(p.cpu_s for p in procs),
        "kinds": {k: {"processes": n, "cpu_s": round(kind_cpu[k], 1)} for k, n in kind_count.items()},
        "modules": {m: {"cpu_s": round(cpu, 1), "processes": dict(modules[m])} for m, cpu in heaviest},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--out", type=Path, help="write the processes and the summary here (JSON)")
    parser.add_argument("--interval", type=float, default=0.3, help="seconds between two readings")
    parser.add_argument("--top", type=int, default=25, help="test modules to print")
    parser.add_argument("pytest_args", nargs="*", default=["tests", "-n", "3"])
    args = parser.parse_args()

    sampler = Sampler(args.interval)
    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as events_file:
        events_path = Path(events_file.name)
    env = {**os.environ, EVENTS_ENV: str(events_path),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "bench"), os.environ.get("PYTHONPATH")]))}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as the Makefile: every process would compile again
    started = time.time()
    sampler.start()
    code = subprocess.call([sys.executable, "-m", "pytest", "-p", "suite_profile", *args.pytest_args], cwd=REPO,
                           env=env)  # fmt: skip
    wall = time.time() - started
    sampler.stopping.set()
    sampler.join()
    events = [json.loads(line) for line in events_path.read_text().splitlines() if line]
    events_path.unlink()
    summary = summarize(sampler.seen.values(), events)

    print(f"\npytest exit {code}; {wall:.0f} s wall; {summary['cpu_s']:.0f} s of CPU in the processes seen "
          f"({summary['cpu_s'] / wall:.2f} cores busy on average)")  # fmt: skip
    minutes: dict[int, list[float]] = defaultdict(list)
    for at, share in sampler.busy:
        minutes[int((at - started) // 60)].append(share)
    print("busy share of all cores, per minute:",
          " ".join(f"{m}:{sum(v) / len(v):.2f}" for m, v in sorted(minutes.items())))  # fmt: skip
    print(f"\n{'kind':<34} {'processes':>9} {'CPU s':>8}")
    for kind, row in sorted(summary["kinds"].items(), key=lambda kv: -kv[1]["cpu_s"]):
        print(f"{kind:<34} {row['processes']:>9} {row['cpu_s']:>8.1f}")
    print(f"\n{'test module (processes it started)':<64} {'CPU s':>8}  processes")
    for module, row in list(summary["modules"].items())[: args.top]:
        print(f"{module:<64} {row['cpu_s']:>8.1f}  {row['processes']}")
    if args.out:
        args.out.write_text(json.dumps({**summary, "wall_s": wall, "pytest_exit": code, "busy": sampler.busy,
                                        "processes": [asdict(p) for p in sampler.seen.values()]}))  # fmt: skip
    return code


# The pytest plugin (``-p suite_profile``, this module on PYTHONPATH): which test runs where, and when.
def _log(event: dict[str, Any]) -> None:
    path = os.environ.get(EVENTS_ENV)
    if path:
        with open(path, "a", encoding="utf-8") as f:  # one short line per write: appends do not interleave
            f.write(json.dumps({**event, "worker": os.environ.get("PYTEST_XDIST_WORKER", "main")}) + "\n")


def pytest_configure(config: Any) -> None:
    _log({"event": "worker", "pid": os.getpid()})


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _log({"event": "start", "time": time.time(), "test": nodeid})


if __name__ == "__main__":
    sys.exit(main())
