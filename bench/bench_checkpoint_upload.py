"""What uploading checkpoints to the object store costs a training step (issue 23).

The same job (the bench model of ``bench_training.py``: the packaged pretrained MiniLM on its generated
review text, trainer backend) runs through a worker slot (``worker.execute.execute_job``, in this
process; the run in its own process, as in production) with one save every ``--save-steps`` steps, two
ways that differ in nothing but the artifacts root:

- **off**: a local ``ARTIFACTS_ROOT``; the run saves its checkpoints there and nothing uploads them;
- **on**: ``ARTIFACTS_ROOT=s3://...`` on a SeaweedFS started here (``trainjobs.seaweedfs``, ``weed mini``
  on free ports); the slot's uploader copies each checkpoint to the store while the run trains on.

A step's time is the run's own ``train_runtime_s`` over its steps (the checkpoint writes included on
both sides). Variants alternate, ``--repeats`` times each, and the median counts. It prints both, the
slowdown against the goal (<= 5% at one save every 50 steps), and for "on" the checkpoints uploaded,
their size and the upload times the slot logged.

In a fleet the store runs on other machines; here its CPU is taken from the same cores as training.
``--store-nice N`` runs every thread of the SeaweedFS process at niceness N, to tell the slot's own
cost (hashing and sending, at niceness ``worker.checkpoint_sync.UPLOAD_NICENESS``) from the store's.
``--split-cores`` stands one machine in for two, the shape the goal is for: the training host is CPU 0
(the slot, its uploader and the run, with one torch thread) and the store's host is CPU 1 (SeaweedFS),
so "on" pays what the training host pays (staging, hashing, sending) and not what the store does.

    .venv/bin/python bench/bench_checkpoint_upload.py [--steps 200] [--save-steps 50] [--repeats 2]
        [--store-nice 0] [--split-cores]
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_training import minilm_path, write_data

GOAL = 0.05  # at most 5% slower per step with uploads on
UPLOADED = re.compile(r"checkpoint (\d+) in the store \(([\d.]+) s\)")


class UploadLog(logging.Handler):
    """Collects the slot's "checkpoint N in the store (S s)" lines."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.uploads: list[tuple[int, float]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if match := UPLOADED.search(record.getMessage()):
            self.uploads.append((int(match.group(1)), float(match.group(2))))


def bench_spec(files: dict[str, str], model: Path, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "name": "bench-upload", "task": "text-classification", "model": {"name_or_path": str(model)},
        "dataset": {"path": "csv", "data_files": {"train": files["train"]}},
        "preprocessing": {"max_length": args.max_length},
        "training": {"max_steps": args.steps, "per_device_train_batch_size": args.batch, "seed": 42,
                     "eval_strategy": "no", "logging_steps": 50, "save_steps": args.save_steps},
        "metrics": ["accuracy"],
    }  # fmt: skip


def run_once(spec: dict[str, Any], home: Path, data_root: Path, artifacts_root: str) -> dict[str, Any]:
    """One job through a worker slot; its ms per step and the uploads the slot logged."""
    from sqlalchemy import select

    from service_core.checkpoints import CheckpointStore
    from service_core.db import Base, Job
    from service_core.db.session import get_engine, session_scope
    from service_core.settings import Settings
    from worker.execute import execute_job

    home.mkdir(parents=True)
    settings = Settings.model_validate(
        {"TRAINJOBS_HOME": str(home), "ARTIFACTS_ROOT": artifacts_root, "DATA_ROOT": str(data_root)}
    )
    Base.metadata.create_all(get_engine(settings.database_url))
    with session_scope(settings.database_url) as session:
        job = Job(owner="bench", name=spec["name"], spec=spec)
        session.add(job)
        session.flush()
        job_id = job.id
    uploads = UploadLog()
    logging.getLogger("worker.checkpoint_sync").setLevel(logging.INFO)
    logging.getLogger("worker.checkpoint_sync").addHandler(uploads)
    started = time.perf_counter()
    try:
        status = execute_job(job_id, settings)
    finally:
        logging.getLogger("worker.checkpoint_sync").removeHandler(uploads)
    wall = time.perf_counter() - started
    with session_scope(settings.database_url) as session:
        done = session.execute(select(Job).where(Job.id == job_id)).scalar_one()
        metrics, steps = dict(done.final_metrics or {}), done.progress_step
    assert status == "succeeded", (status, done.error_message)
    stored = [] if "://" not in artifacts_root else CheckpointStore(artifacts_root, job_id).steps()
    return {"ms_per_step": 1000 * float(metrics["train_runtime_s"]) / steps, "steps": steps, "wall_s": wall,
            "uploads": uploads.uploads, "stored": stored}  # fmt: skip


def checkpoint_mb(home: Path) -> float:
    """Size of one local checkpoint of an "off" run (they are all the same size)."""
    found = sorted(home.rglob("checkpoint-*"))
    return sum(f.stat().st_size for f in found[0].rglob("*") if f.is_file()) / 2**20 if found else 0.0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--save-steps", type=int, default=50)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--train", type=int, default=640)
    p.add_argument("--max-length", type=int, default=256)
    p.add_argument("--store-nice", type=int, default=0, help="niceness of the SeaweedFS process's threads")
    p.add_argument("--split-cores", action="store_true",
                   help="training host on CPU 0 (one torch thread), the store on CPU 1")  # fmt: skip
    return p


def threads(pid: int) -> list[int]:
    """Every thread of ``pid``: on Linux niceness and CPU affinity are per thread (new threads inherit
    their creator's)."""
    return [int(task.name) for task in Path(f"/proc/{pid}/task").iterdir()]


def renice_process(pid: int, niceness: int) -> None:
    for tid in threads(pid):
        os.setpriority(os.PRIO_PROCESS, tid, niceness)


def pin_process(pid: int, cpus: set[int]) -> None:
    for tid in threads(pid):
        os.sched_setaffinity(tid, cpus)


def main() -> None:
    from trainjobs.seaweedfs import SeaweedFS

    args = parser().parse_args()
    logging.basicConfig(level=logging.WARNING)
    results: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp, SeaweedFS(data_dir=Path(tmp) / "seaweedfs") as store:
        os.environ.update(store.aws_env())  # the slot's s3fs reads the standard variables, as deployed
        if args.store_nice and store.process is not None:
            renice_process(store.process.pid, args.store_nice)
        if args.split_cores and store.process is not None:
            # The run inherits this process's CPU and its OMP_NUM_THREADS (the run environment passes OMP_*).
            os.environ["OMP_NUM_THREADS"] = "1"
            pin_process(os.getpid(), {0})
            pin_process(store.process.pid, {1})
        # A run reads nothing outside its data root (trainer_core/path_guard.py): the data and a copy
        # of the packaged model go there.
        data_root = Path(tmp) / "data"
        data_root.mkdir()
        files = write_data(data_root, args.train, 16)
        model = shutil.copytree(minilm_path(), data_root / "models" / "minilm")
        spec = bench_spec(files, model, args)
        for repeat in range(args.repeats):
            for mode in ("off", "on") if repeat % 2 == 0 else ("on", "off"):
                home = Path(tmp) / f"{mode}-{repeat}"
                root = store.url(f"bench/{uuid.uuid4().hex[:8]}") if mode == "on" else str(home / "artifacts")
                result = run_once(spec, home, data_root, root)
                results[mode].append(result)
                print(f"{mode:>3} run {repeat + 1}: {result['ms_per_step']:.1f} ms/step over {result['steps']} steps, "
                      f"wall {result['wall_s']:.0f} s, uploads {result['uploads']}", flush=True)  # fmt: skip
        size = checkpoint_mb(Path(tmp) / "off-0")
    off = statistics.median(r["ms_per_step"] for r in results["off"])
    on = statistics.median(r["ms_per_step"] for r in results["on"])
    slower = on / off - 1
    upload_s = [s for r in results["on"] for _, s in r["uploads"]]
    print(f"\nMiniLM-L6, batch {args.batch}, max_length {args.max_length}, {args.steps} steps, a save every "
          f"{args.save_steps} steps, checkpoint {size:.0f} MiB, store niceness {args.store_nice}"
          + (", training host CPU 0 (1 thread), store CPU 1" if args.split_cores else ""))  # fmt: skip
    print(f"{'uploads':>8} {'ms/step (median of ' + str(args.repeats) + ')':>26}")
    print(f"{'off':>8} {off:26.1f}\n{'on':>8} {on:26.1f}")
    print(f"slower with uploads on: {slower:+.1%} (goal <= {GOAL:.0%}): {'PASS' if slower <= GOAL else 'MISS'}")
    if upload_s:
        print(f"uploads: {len(upload_s)}, {statistics.median(upload_s):.1f} s median, {max(upload_s):.1f} s max; "
              f"stored at the end: {[r['stored'] for r in results['on']]}")  # fmt: skip


if __name__ == "__main__":
    main()
