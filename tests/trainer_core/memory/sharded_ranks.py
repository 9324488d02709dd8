"""Run by test_sharding_agreement.py: every rank builds each spec's model and optimizer as a run does
(DDP, or trainer_core.sharding.shard_model), takes one optimizer step on random tokens, and writes one
JSON line per spec with its memory values and the mean loss of two steps to OUT/rank-R.jsonl (one file
per rank: the ranks' lines would interleave on a shared stdout).

    python -m tests.trainer_core.memory.sharded_ranks W=OUT [W=OUT ...]

launches, for each pair, torchrun of W ranks over OUT's spec files, one after the other. The ranks are
forks of this process (trainer_core.launch.ForkedLauncher), with torch and the models imported once:
each new interpreter torchrun would start spends seconds of CPU on those imports alone.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from trainer_core.backends.common import build_training_model
from trainer_core.launch import ForkedLauncher
from trainer_core.memory_report import memory_values
from trainer_core.optimizers import build_optimizer
from trainer_core.preimport import unsafe_to_fork
from trainer_core.sharding import shard_model
from trainer_core.spec import JobSpec, load_spec_file

VOCAB_ROWS, LENGTH = 4, 9
RANKS_MODULE = "tests.trainer_core.memory.sharded_ranks"  # each forked rank calls its main


def batch(spec: JobSpec, vocab: int, seed: int) -> dict[str, torch.Tensor]:
    """The same rows on every rank for a seed (each rank then takes its own half, as a sampler would)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (VOCAB_ROWS * dist.get_world_size(), LENGTH), generator=g)
    mine = ids.chunk(dist.get_world_size())[dist.get_rank()]
    if spec.task == "causal-lm":
        return {"input_ids": mine, "labels": mine}
    labels = torch.randint(0, 3, (ids.shape[0],), generator=g).chunk(dist.get_world_size())[dist.get_rank()]
    return {"input_ids": mine, "labels": labels}


def one_spec(path: str) -> dict[str, object]:
    spec = load_spec_file(path)
    model = build_training_model(spec, ["a", "b", "c"])
    vocab = int(model.config.vocab_size)
    if spec.fsdp_settings is not None:
        shard_model(model, spec, torch.device("cpu"))
        trained = model
    else:
        trained = DistributedDataParallel(model)
    optimizer = build_optimizer(model, spec.optimizer, spec.training.learning_rate, spec.training.weight_decay)
    losses = []
    for seed in range(2):
        loss = trained(**batch(spec, vocab, seed)).loss
        loss.backward()
        optimizer.step()
        if seed == 0:
            values = memory_values(model, optimizer)
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
    return {"spec": path, "rank": dist.get_rank(), "values": values, "losses": losses}


def main(argv: list[str]) -> int:
    """One rank: ``OUT SPEC.json [SPEC.json ...]``."""
    dist.init_process_group("gloo")
    out = Path(argv[0]) / f"rank-{dist.get_rank()}.jsonl"
    try:
        with out.open("w", encoding="utf-8") as lines:
            for path in argv[1:]:
                lines.write(json.dumps(one_spec(path)) + "\n")
    finally:
        dist.destroy_process_group()
    return 0


def launch(world: int, out: Path) -> int:
    """torchrun of ``world`` ranks over ``out``'s spec files, its launcher and ranks forks of this process."""
    specs = sorted(str(path) for path in out.glob("*.json"))
    launcher = ForkedLauncher(["--standalone", f"--nproc_per_node={world}", "-m", RANKS_MODULE, str(out), *specs])
    assert launcher.stdout is not None
    launcher.stdout.read()  # the ranks write their files; a full pipe would stop them
    return launcher.wait()


if __name__ == "__main__":
    if why := unsafe_to_fork():
        raise SystemExit(f"cannot fork the ranks: {why}")
    for pair in sys.argv[1:]:
        world, out = pair.split("=", 1)
        if status := launch(int(world), Path(out)):
            raise SystemExit(status)
