"""Sharded runs (issue 28): the estimate's per-rank parameter, gradient and optimizer-state bytes equal,
to the byte and on every rank, what real ranks hold after their first optimizer step, on gloo at world
sizes 2 and 4, for a tiny Llama and a tiny BERT, under DDP, FSDP full shard, shard-grad-op, CPU
offload and activation checkpointing. The shapes are odd on purpose (a 3-row classifier on 4 ranks:
the last rank holds no row, yet its padded storage), so padding is exercised. The same launch trains
two steps each way: FSDP's loss equals DDP's.

The ranks run tests/trainer_core/memory/sharded_ranks.py, which builds each model as a run does: one process
for both world sizes, the ranks forked from it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.trainer_core.memory.sharded_ranks import RANKS_MODULE
from trainer_core.memory import estimate_memory
from trainer_core.spec import JobSpec, parse_spec

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[3]
WORLDS = (2, 4)
MODELS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("causal-lm", {
        "model_type": "llama", "vocab_size": 101, "hidden_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 45,
        "max_position_embeddings": 64,
    }),
    "bert": ("text-classification", {
        "model_type": "bert", "vocab_size": 99, "hidden_size": 30, "num_hidden_layers": 2,
        "num_attention_heads": 2, "intermediate_size": 37, "max_position_embeddings": 64, "num_labels": 3,
    }),
}  # fmt: skip
MODES: dict[str, dict[str, Any]] = {
    "ddp": {"sharding": "none"},
    "full_shard": {"sharding": "fsdp"},
    "shard_grad_op": {"sharding": "fsdp", "fsdp": {"strategy": "shard_grad_op"}},
    "cpu_offload": {"sharding": "fsdp", "fsdp": {"cpu_offload": True}},
    "checkpointed": {"sharding": "fsdp", "gradient_checkpointing": True},  # activation checkpointing under FSDP
}


def spec_for(arch: str, mode: str, world: int) -> JobSpec:
    task, config = MODELS[arch]
    dataset = {"path": "json"} if task == "causal-lm" else {"path": "csv", "text_column": "t", "label_column": "l"}
    return parse_spec({
        "name": f"{arch}-{mode}", "task": task, "model": {"config": config}, "dataset": dataset,
        "training": {"backend": "accelerate", "learning_rate": 1e-2, "seed": 7},
        "efficiency": MODES[mode], "resources": {"num_processes": world},
    })  # fmt: skip


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict[str, Any]]]:
    """Every (model, mode) case, measured on every rank of each world size: one process launches both."""
    folders = {world: tmp_path_factory.mktemp(f"world{world}") for world in WORLDS}
    for world, folder in folders.items():
        for arch in MODELS:
            for mode in MODES:
                spec = spec_for(arch, mode, world)
                (folder / f"{arch}-{mode}.json").write_text(spec.model_dump_json(), encoding="utf-8")
    cmd = [sys.executable, "-m", RANKS_MODULE, *(f"{w}={f}" for w, f in folders.items())]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    lines = {world: [json.loads(line) for rank in range(world) for line in (folder / f"rank-{rank}.jsonl").open()]
             for world, folder in folders.items()}  # fmt: skip
    for world in WORLDS:
        assert len(lines[world]) == world * len(MODELS) * len(MODES)
    return lines


@pytest.fixture(params=WORLDS, ids=[f"world{world}" for world in WORLDS])
def ranks(
    request: pytest.FixtureRequest, measured: dict[int, list[dict[str, Any]]]
) -> tuple[int, list[dict[str, Any]]]:
    world: int = request.param
    return world, measured[world]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("arch", MODELS)
def test_every_rank_holds_what_the_estimate_says(ranks: tuple[int, list[dict[str, Any]]], arch: str, mode: str) -> None:
    world, lines = ranks
    spec = spec_for(arch, mode, world)
    measured = {line["rank"]: line["values"] for line in lines if line["spec"].endswith(f"/{arch}-{mode}.json")}
    assert sorted(measured) == list(range(world))
    for rank, values in measured.items():
        estimate = estimate_memory(spec, rank=rank)
        assert values["parameter_bytes"] == estimate.parameter_bytes, (rank, "parameters")
        assert values["gradient_bytes"] == estimate.gradient_bytes, (rank, "gradients")
        assert values["optimizer_state_bytes"] == estimate.optimizer_state_bytes, (rank, "optimizer state")
    if mode != "ddp":  # sharding holds less than a whole model on every rank
        whole = estimate_memory(spec_for(arch, "ddp", world))
        assert estimate_memory(spec).parameter_bytes < whole.parameter_bytes
    if mode == "cpu_offload":  # the shards are the host's: the device total leaves them out
        estimate = estimate_memory(spec)
        assert estimate.host_bytes == (
            estimate.parameter_bytes + estimate.gradient_bytes + estimate.optimizer_state_bytes
        )
        on_device = estimate_memory(spec_for(arch, "full_shard", world))
        assert estimate.total_bytes < on_device.total_bytes


@pytest.mark.parametrize("arch", MODELS)
def test_fsdp_trains_to_ddps_loss(ranks: tuple[int, list[dict[str, Any]]], arch: str) -> None:
    _, lines = ranks
    losses = {mode: next(line["losses"] for line in lines if line["spec"].endswith(f"/{arch}-{mode}.json"))
              for mode in MODES}  # fmt: skip
    assert losses["ddp"][1] != losses["ddp"][0]  # the second step saw updated weights
    for mode in ("full_shard", "shard_grad_op", "cpu_offload", "checkpointed"):
        assert losses[mode] == pytest.approx(losses["ddp"], rel=1e-5), mode
