"""Sharded and multi-node training on this machine: each rank's memory, estimated against measured, and
steps/s, for DDP and each FSDP mode, side by side in one torchrun launch per world size (gloo on the CPU);
then one world of 2 as 2 nodes x 1 process (two torchrun agents meeting at a c10d rendezvous, as two
machines would) against 1 node x 2 processes, with the time from launch to every rank training.

DDP (``efficiency.sharding: none``, torch's ``DistributedDataParallel``, what a user runs without
sharding) is the baseline. Every mode builds the model as a run does (``build_training_model``, then
``trainer_core.sharding.shard_model``), trains ``--steps`` steps of ``--batch`` x ``--length`` random
tokens per rank after ``--warmup`` unmeasured ones, and reports its rank's parameter, gradient and
optimizer-state bytes (the run's memory event) beside ``estimate_memory(spec, rank=r)``.

    .venv/bin/python bench/bench_sharding.py [--worlds 2,4] [--steps 10] [--hidden 256] [--layers 4] [--no-nodes]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODES: dict[str, dict[str, Any]] = {
    "ddp": {"sharding": "none"},
    "full_shard": {"sharding": "fsdp"},
    "shard_grad_op": {"sharding": "fsdp", "fsdp": {"strategy": "shard_grad_op"}},
    "cpu_offload": {"sharding": "fsdp", "fsdp": {"cpu_offload": True}},
}
PARTS = ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes")


def spec_doc(args: argparse.Namespace, mode: str, world: int, nodes: int = 1) -> dict[str, Any]:
    config = {
        "model_type": "llama", "vocab_size": 1000, "hidden_size": args.hidden, "num_hidden_layers": args.layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": args.hidden * 3 - 5,
        "max_position_embeddings": 256,
    }  # fmt: skip
    return {
        "name": f"bench-{mode}", "task": "causal-lm", "model": {"config": config}, "dataset": {"path": "json"},
        "training": {"backend": "accelerate", "learning_rate": 1e-3, "seed": 0},
        "efficiency": MODES[mode], "resources": {"num_processes": world // nodes, "num_nodes": nodes},
    }  # fmt: skip


def rank_main(out: Path, specs: list[str], steps: int, warmup: int, batch: int, length: int) -> None:
    """One rank: every spec in turn (under torchrun)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from trainer_core.backends.common import build_training_model
    from trainer_core.memory_report import memory_values
    from trainer_core.optimizers import build_optimizer
    from trainer_core.sharding import shard_model
    from trainer_core.spec import load_spec_file

    launched = float(os.environ["BENCH_LAUNCHED"])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    rows = []
    for path in specs:
        spec = load_spec_file(path)
        model = build_training_model(spec, [])
        if spec.fsdp_settings is not None:
            trained = shard_model(model, spec, torch.device("cpu"))
        else:
            trained = DistributedDataParallel(model)
        optimizer = build_optimizer(model, spec.optimizer, spec.training.learning_rate, spec.training.weight_decay)
        g = torch.Generator().manual_seed(rank)
        values: dict[str, Any] = {}
        started = 0.0
        first_step = 0.0
        for step in range(warmup + steps):
            if step == warmup:
                dist.barrier()
                started = time.perf_counter()
            ids = torch.randint(0, 1000, (batch, length), generator=g)
            trained(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            if step == 0:
                values = memory_values(model, optimizer)
                first_step = time.time() - launched  # from the launch to this rank's first step done
            optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        rate = steps / (time.perf_counter() - started)
        rows.append({"spec": path, "rank": rank, "values": values, "steps_per_s": rate, "first_step_s": first_step})
        launched = time.time()  # the next spec's clock starts when this one ends
    (out / f"rank-{rank}.json").write_text(json.dumps(rows), encoding="utf-8")
    dist.destroy_process_group()


def launch(args: argparse.Namespace, folder: Path, paths: list[str], nodes: int, per_node: int) -> list[dict[str, Any]]:
    """torchrun on ``nodes`` agents of ``per_node`` processes (several: a c10d rendezvous on this machine);
    every rank's rows."""
    from trainer_core.launch import Rendezvous
    from trainjobs.seaweedfs import free_port

    common = [__file__, "--rank-out", str(folder), "--steps", str(args.steps), "--warmup", str(args.warmup),
              "--batch", str(args.batch), "--length", str(args.length), *paths]  # fmt: skip
    # One thread a process, as torchrun sets it for several processes a node: two one-process "nodes" on
    # one machine would each take every core and spin against each other (a cost real nodes do not pay).
    env = {**os.environ, "PYTHONPATH": str(ROOT), "BENCH_LAUNCHED": str(time.time()), "OMP_NUM_THREADS": "1"}
    # several nodes: the engine's own rendezvous arguments (trainer_core/launch.py), one agent each
    where = [["--standalone"]] if nodes == 1 else [Rendezvous(f"127.0.0.1:{free_port()}", "bench").args(nodes)] * nodes
    torchrun = [sys.executable, "-m", "torch.distributed.run"]
    agents = [
        subprocess.Popen([*torchrun, *w, f"--nproc_per_node={per_node}", *common], env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for w in where
    ]
    for agent in agents:
        _, err = agent.communicate()
        if agent.returncode:
            raise SystemExit(f"torchrun failed:\n{err[-3000:]}")
    world = nodes * per_node
    return [row for r in range(world) for row in json.loads((folder / f"rank-{r}.json").read_text())]


def run_nodes(args: argparse.Namespace) -> list[tuple[str, str, float, float]]:
    """(mode, layout, steps/s, seconds from launch to every rank's first step) for 1 x 2 and 2 x 1."""
    out = []
    for mode in ("ddp", "full_shard"):
        for nodes, per_node in ((1, 2), (2, 1)):
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp) / f"{mode}.json"
                path.write_text(json.dumps(spec_doc(args, mode, 2, nodes)), encoding="utf-8")
                rows = launch(args, Path(tmp), [str(path)], nodes, per_node)
            layout = f"{nodes} node{'s' if nodes > 1 else ''} x {per_node} process{'es' if per_node > 1 else ''}"
            out.append((mode, layout, min(r["steps_per_s"] for r in rows), max(r["first_step_s"] for r in rows)))
    return out


def run_world(args: argparse.Namespace, world: int) -> list[dict[str, Any]]:
    from trainer_core.memory import estimate_memory
    from trainer_core.spec import parse_spec

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        paths = []
        for mode in MODES:
            path = folder / f"{mode}.json"
            path.write_text(json.dumps(spec_doc(args, mode, world)), encoding="utf-8")
            paths.append(str(path))
        measured = launch(args, folder, paths, 1, world)
    out = []
    for mode in MODES:
        spec = parse_spec(spec_doc(args, mode, world))
        mine = [row for row in measured if row["spec"].endswith(f"/{mode}.json")]
        for row in sorted(mine, key=lambda row: row["rank"]):
            estimate = estimate_memory(spec, rank=row["rank"])
            est = {part: getattr(estimate, part) for part in PARTS}
            out.append({"world": world, "mode": mode, "rank": row["rank"], "measured": row["values"],
                        "estimate": est, "steps_per_s": row["steps_per_s"]})  # fmt: skip
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--no-nodes", action="store_true", help="skip the 2 nodes x 1 process comparison")
    parser.add_argument("--rank-out", type=Path, help=argparse.SUPPRESS)  # the ranks' own entry
    parser.add_argument("specs", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_out is not None:
        rank_main(args.rank_out, args.specs, args.steps, args.warmup, args.batch, args.length)
        return
    kib = 1024
    print("| world | mode | rank | params est / measured KiB | grads est / measured KiB | optimizer est / measured KiB "
          "| exact | steps/s | vs DDP |")
    print("|---|---|---|---|---|---|---|---|---|")
    exact_everywhere = True
    for world in (int(w) for w in args.worlds.split(",")):
        rows = run_world(args, world)
        ddp = min(row["steps_per_s"] for row in rows if row["mode"] == "ddp")
        for row in rows:
            exact = all(row["measured"][part] == row["estimate"][part] for part in PARTS)
            exact_everywhere &= exact
            cells = " | ".join(f"{row['estimate'][p] / kib:,.1f} / {row['measured'][p] / kib:,.1f}" for p in PARTS)
            print(f"| {world} | {row['mode']} | {row['rank']} | {cells} | {'yes' if exact else 'NO'} "
                  f"| {row['steps_per_s']:.2f} | {row['steps_per_s'] / ddp:.2f}x |")
    print(f"\nestimate == measured on every rank and part: {'yes' if exact_everywhere else 'NO'}")
    if not args.no_nodes:
        print("\n| mode | layout (world 2) | steps/s | launch to every rank's first step, s |\n|---|---|---|---|")
        for mode, layout, rate, first in run_nodes(args):
            print(f"| {mode} | {layout} | {rate:.2f} | {first:.1f} |")
    sys.exit(0 if exact_everywhere else 1)


if __name__ == "__main__":
    main()
