"""A multi-node job through the service: 2 nodes x 1 process against 1 node x 2 processes (issue 28).

    .venv/bin/python bench/bench_multi_node.py [--steps 30] [--rounds 2]

One API and two workers on this machine (each worker a "machine": its own ``TRAINJOBS_HOME``, one CPU
slot; the database, broker, artifacts and data shared), on the embedded default. The job is the
example spec (the packaged MiniLM on the example sentiment CSV) cut to ``--steps`` steps, submitted
as ``num_nodes: 2`` (a gang: one slot of each worker, worker/gang.py) and as ``num_processes: 2`` (one
slot, torchrun's two processes on it), the same world of 2 and the same global batch, interleaved for
``--rounds`` rounds. Per layout (medians):

- submit -> running: the claim, or for the gang its join, recruit and formation;
- submit -> first step: every rank has trained a step (DDP's all-reduce waits for all of them);
- steps/s from the first step to the last, and the loss of the last step (the two must agree).

Each worker runs its training with ``OMP_NUM_THREADS=1``, as torchrun sets for the two processes of
one node: two one-process "machines" on two cores would otherwise each take both cores.
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

from bench_api import Service, free_port, service_env, wait_until_ready

from service_core.settings import Settings
from trainjobs.launcher import write_example
from trainjobs.sse import iter_events
from worker.processes import stop_processes
from worker.procfs import processes_mentioning

REPO = Path(__file__).resolve().parents[1]
KEY = "tj_bench-multi-node-admin-key"
LAYOUTS = {"2 nodes x 1 process": {"num_nodes": 2, "num_processes": 1},
           "1 node x 2 processes": {"num_nodes": 1, "num_processes": 2}}  # fmt: skip


def stamp(value: str) -> float:
    return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


@contextmanager
def two_workers() -> Iterator[Service]:
    """Migrations, ``trainjobs serve`` and two ``trainjobs worker`` with homes of their own."""
    root = Path(tempfile.mkdtemp(prefix="trainjobs-multi-node-"))
    shared = {"DATABASE_URL": f"sqlite:///{root}/trainjobs.db", "BROKER_URL": f"sqla+sqlite:///{root}/broker.db",
              "ARTIFACTS_ROOT": str(root / "artifacts"), "DATA_ROOT": str(root / "data"),
              "TRAINJOBS_API_KEY": KEY}  # fmt: skip
    logs = root / "logs"
    logs.mkdir()
    procs: list[subprocess.Popen[bytes]] = []

    def start(name: str, argv: list[str], **extra: str) -> None:
        env = service_env({**shared, "TRAINJOBS_HOME": str(root / name), **extra})
        with (logs / f"{name}.log").open("wb") as log:
            procs.append(subprocess.Popen(argv, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True))  # fmt: skip

    try:
        env = service_env({**shared, "TRAINJOBS_HOME": str(root / "api")})
        subprocess.run([sys.executable, "-m", "alembic", "upgrade", "head"], env=env, cwd=REPO, check=True,
                       capture_output=True)  # fmt: skip
        port = free_port()
        start("api", [sys.executable, "-m", "trainjobs.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                      "--no-access-log"])  # fmt: skip
        for name in ("node-a", "node-b"):
            start(name, [sys.executable, "-m", "trainjobs.cli", "worker", "--queue", "default"], OMP_NUM_THREADS="1")
        settings = Settings.model_validate({**shared, "TRAINJOBS_HOME": str(root / "api")})
        service = Service(f"http://127.0.0.1:{port}", KEY, root, settings.data_root, "default", logs / "node-a.log")
        wait_until_ready(service, procs)
        deadline = time.monotonic() + 120  # both workers' heartbeats: a 2-node submit needs them
        while _workers(root) < 2:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the two workers did not start; see {logs}")
            time.sleep(1)
        yield service
    finally:
        for proc in reversed(procs):
            stop_processes([proc], 45, "service process")
        for pid in processes_mentioning(str(root)):
            os.kill(pid, signal.SIGKILL)


def _workers(root: Path) -> int:
    import sqlite3

    with sqlite3.connect(root / "trainjobs.db") as conn:
        return int(conn.execute("SELECT count(*) FROM workers").fetchone()[0])


def run_once(service: Service, spec: dict[str, Any], resources: dict[str, int]) -> dict[str, float]:
    headers = {"Authorization": f"Bearer {service.api_key}"}
    progress: list[tuple[int, float]] = []
    with httpx.Client(base_url=service.url, headers=headers, timeout=httpx.Timeout(30, read=600)) as client:
        submitted = time.time()
        created = client.post("/v1/jobs", json={**spec, "resources": resources})
        assert created.status_code == 201, created.text
        job_id = created.json()["id"]
        with client.stream("GET", f"/v1/jobs/{job_id}/events") as response:
            for event in iter_events(response):
                if event.event == "progress":
                    progress.append((int(event.data["step"]), stamp(event.data["time"])))
        job = client.get(f"/v1/jobs/{job_id}").json()
        losses = [p["value"] for p in client.get(f"/v1/jobs/{job_id}/metrics", params={"limit": 1000}).json()["items"]
                  if p["name"] == "loss"]  # fmt: skip
    assert job["status"] == "succeeded", job
    (first_step, first_t), (last_step, last_t) = progress[0], progress[-1]
    return {"submit_to_running_s": stamp(job["started_at"]) - submitted, "submit_to_first_step_s": first_t - submitted,
            "steps_per_s": (last_step - first_step) / max(last_t - first_t, 1e-9), "last_loss": losses[-1]}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in LAYOUTS}
    with two_workers() as service:
        home = service.home / "bench"
        home.mkdir(exist_ok=True)
        example = Settings.model_validate({"TRAINJOBS_HOME": str(home), "DATA_ROOT": str(service.data_root)})
        spec = json.loads(write_example(example).read_text())
        spec["training"].update({"max_steps": args.steps, "eval_strategy": "no", "logging_steps": 1, "seed": 3})
        for round_ in range(args.rounds):
            order = list(LAYOUTS) if round_ % 2 == 0 else list(reversed(LAYOUTS))
            for name in order:
                runs[name].append(run_once(service, spec, LAYOUTS[name]))
                print(name, runs[name][-1], flush=True)
    print("\n| layout | submit -> running, s | submit -> first step, s | steps/s | last loss |")
    print("|---|---|---|---|---|")
    for name, results in runs.items():
        med = {key: statistics.median(r[key] for r in results) for key in results[0]}
        print(f"| {name} | {med['submit_to_running_s']:.2f} | {med['submit_to_first_step_s']:.2f} | "
              f"{med['steps_per_s']:.2f} | {med['last_loss']:.6f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
