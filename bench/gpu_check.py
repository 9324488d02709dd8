"""One GPU check for the day a device is lent: memory estimate, throughput, MFU and faults, one table.

    .venv/bin/python bench/gpu_check.py [--out results.json] [--only memory,throughput,mfu,faults]
    .venv/bin/python bench/gpu_check.py --smoke [--fork-runs] [--out results.json]   # CPU, tiny configs, in the suite

On one CUDA device (budget: under 8 minutes on an H200) it runs, and prints with PASS/MISS:

1. **memory**: ``estimate_memory`` (without its overhead constant, which the allocator does not count)
   against ``torch.cuda.max_memory_allocated`` over 3 optimizers x gradient checkpointing x fp32/bf16 on
   BERT-base and ViT-base (catalog configs, random weights and data: offline), plus fp16 with the grad
   scaler; a few real steps each, the way both backends train. Goal: ratio within 0.9-1.1. Then
   Llama-3.2-1B causal-lm full / LoRA / QLoRA, and LoRA with the chunked loss and with Liger's
   kernels, whose loss and gradients are also checked against the plain loss (``bench/gpu_llm.py``).
2. **throughput**: samples/s of both trainjobs backends against the tuned Trainer script
   (``bench/bench_training.py``: dynamic padding + length grouping) on the GPU, bf16. Goal: >= 1.0x.
3. **mfu**: model FLOPs utilisation of a BERT-base bf16 training step (no goal set: reported).
4. **faults**: cancellation, SIGKILL-resume and the OOM fault through ``trainjobs train`` (``bench/gpu_faults.py``).

Every check is fenced: one that raises becomes an ERROR row and the others still run. Exit status: 2
without CUDA (and without ``--smoke``), 1 if a row is ERROR (or MISS on a GPU), else 0. ``--smoke`` runs
the same code on the CPU with tiny models and a couple of steps: memory rows then check the optimizer
state to the byte (a CPU has no allocator peak), throughput rows report without a goal.
``--fork-runs`` starts the fault checks' runs the way a worker slot does, forked from one pre-imported
parent (``worker/forkserver.py``) that imports while the other sections run, instead of a fresh interpreter
per run (seven of them, each importing torch first); the suite's smoke run uses it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The checks import torch and the engine only once the arguments are known to be good (fast refusals).
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

Row = dict[str, Any]
SECTIONS = ("memory", "throughput", "mfu", "faults")
# bench_training.py's arguments: on the GPU, and the smoke run's (a couple of steps per variant).
GPU_TRAINING = ["--train", "8000", "--val", "500", "--batch", "32", "--precision", "bf16", "--repeats", "1"]
SMOKE_TRAINING = ["--train", "16", "--val", "8", "--batch", "8", "--max-length", "32", "--repeats", "1"]


def throughput_rows(smoke: bool, root: Path) -> list[Row]:
    """bench_training's four variants on this device; the two backends against the tuned script."""
    import bench_training

    argv = SMOKE_TRAINING if smoke else GPU_TRAINING
    args = bench_training.parser().parse_args(argv)
    results = bench_training.compare(bench_training.minilm_path(), args, root)
    rows = []
    for r in bench_training.goal_rows(results):
        status = "INFO" if smoke or r["status"] == "-" else r["status"]
        rows.append({"section": "throughput", "check": r["name"], "value": f"{r['vs_tuned']:.2f}x tuned",
                     "goal": "-" if r["status"] == "-" else f">= {bench_training.GOAL:.1f}x", "status": status,
                     "detail": f"{r['samples_per_s']:.1f} samples/s, accuracy {r['accuracy']:.3f}, "
                               f"{r['vs_tutorial']:.2f}x tutorial"})  # fmt: skip
    return rows


def run_sections(sections: list[str], smoke: bool, root: Path, fork_runs: bool = False) -> list[Row]:
    """Each section in turn; a section that raises outside its fenced checks becomes one ERROR row."""
    import bench_training
    import gpu_faults
    from gpu_llm import llm_memory_rows
    from gpu_memory import error_row, fenced, memory_rows, mfu_row

    # Before the first section: with --fork-runs the runs' parent imports while the other sections run.
    runs = gpu_faults.Runs(fork=fork_runs and "faults" in sections)
    rows: list[Row] = []
    try:
        for section in sections:
            started = time.perf_counter()
            work = root / section
            work.mkdir()
            try:
                if section == "memory":
                    rows += memory_rows(smoke)
                    rows += llm_memory_rows(smoke)
                elif section == "mfu":
                    rows.append(fenced("mfu", f"{'tiny-bert' if smoke else 'BERT-base'} training step",
                                       lambda: mfu_row(smoke)))  # fmt: skip
                elif section == "throughput":
                    rows += throughput_rows(smoke, work)
                else:
                    rows += gpu_faults.fault_rows(runs, work, bench_training.write_data(work, 96, 16), smoke)
            except Exception as exc:
                rows.append(error_row(section, f"{section} (all)", exc))
            print(f"[gpu_check] {section}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    finally:
        runs.close()
    return rows


def print_table(rows: list[Row]) -> None:
    print(f"\n{'section':<10} {'check':<48} {'value':<34} {'goal':<32} {'status':<7} detail")
    for r in rows:
        print(f"{r['section']:<10} {r['check']:<48} {r['value']:<34} {r['goal']:<32} {r['status']:<7} {r['detail']}")
    counts = {s: sum(r["status"] == s for r in rows) for s in ("PASS", "MISS", "ERROR", "SKIPPED", "INFO")}
    print("\n" + ", ".join(f"{n} {s}" for s, n in counts.items()))


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--smoke", action="store_true", help="CPU, tiny models, a couple of steps")
    p.add_argument("--out", type=Path, help="also write the table as JSON to this file")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--fork-runs", action="store_true",
                   help="fork the fault checks' runs from one pre-imported parent, as worker slots do")  # fmt: skip
    args = p.parse_args(argv)
    sections = [s for s in args.only.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        p.error(f"--only: unknown section(s) {sorted(unknown)}")
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print("gpu_check: no CUDA device found. Run it on a CUDA machine, or with --smoke to check the "
              "script itself on the CPU.", file=sys.stderr)  # fmt: skip
        return 2
    if args.smoke:  # tiny models run faster on one thread than fighting over shared cores
        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        rows = run_sections(sections, args.smoke, Path(tmp), args.fork_runs)
    wall = time.perf_counter() - started
    print_table(rows)
    device = "cpu (smoke)" if args.smoke else torch.cuda.get_device_name()
    print(f"device: {device}; wall time {wall:.0f} s")
    if args.out:
        report = {"device": device, "smoke": args.smoke, "wall_s": wall, "rows": rows}
        args.out.write_text(json.dumps(report, indent=1), encoding="utf-8")
    bad = {"ERROR"} if args.smoke else {"ERROR", "MISS"}
    return 1 if any(r["status"] in bad for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
