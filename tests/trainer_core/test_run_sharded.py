"""Sharded runs (``efficiency.sharding: fsdp``, issue 28) through the run itself, under torchrun (gloo), on
the accelerate backend. Each rank's bytes against the estimate, for every mode and world size, are
tests/trainer_core/memory/test_sharding_agreement.py's.

Runs of one global batch (micro-batch x processes) on different world sizes, 4 ranks x 4 rows and
2 x 8, see the same examples in each step (a plain shuffle, no length grouping, which groups by the
micro-batch) and no dropout, so they agree to float rounding: their gradient norms (over the whole
batch), evaluations and weights, not their logged losses (rank 0's own rows)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.trainer_core import datagen
from tests.trainer_core.runhelpers import assert_same_weights, done_event, evaluate_saved, run, text_spec
from trainer_core.checkpoint import complete_checkpoints
from trainer_core.memory import estimate_memory
from trainer_core.sharding import SHARDED_DIR
from trainer_core.spec import JobSpec

NO_DROPOUT = {"config": {**datagen.TINY_BERT, "hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}}


def spec_for(tmp_path: Path, sharding: str, processes: int) -> JobSpec:
    # 64 rows / 16 a step: 4 steps an epoch, 8 in all; gradients clipped (max_grad_norm 1.0) every step
    training = {"num_train_epochs": 2, "per_device_train_batch_size": 16 // processes, "learning_rate": 3e-3,
                "logging_steps": 1, "save_steps": 4, "eval_strategy": "epoch"}  # fmt: skip
    return text_spec(
        tmp_path / "data", "accelerate", n_train=64, n_val=31, model=NO_DROPOUT, training=training,
        preprocessing={"group_by_length": False},
        efficiency={"sharding": sharding}, resources={"num_processes": processes},
    )  # fmt: skip


def norms(events: Any) -> list[float]:
    """The gradient norm of every step: the whole batch's, whichever ranks computed it."""
    return [e["values"]["grad_norm"] for e in events.of_kind("metric")]


@pytest.mark.slow
def test_a_sharded_run_trains_as_ddp_does_and_resumes_from_its_shards_on_fewer_ranks(tmp_path: Path) -> None:
    spec = spec_for(tmp_path, "fsdp", 4)
    status, fsdp = run(spec, tmp_path / "fsdp")
    assert status == "succeeded", done_event(fsdp)
    status, ddp = run(spec_for(tmp_path, "none", 2), tmp_path / "ddp")
    assert status == "succeeded", done_event(ddp)

    # the same training: gradient norms at every step (clipped over the shards), evaluations, weights
    assert len(norms(fsdp)) == 8
    assert norms(fsdp) == pytest.approx(norms(ddp), rel=1e-4)
    final = done_event(fsdp)["summary"]["eval"]
    assert final["eval_loss"] == pytest.approx(done_event(ddp)["summary"]["eval"]["eval_loss"], rel=1e-5)
    assert_same_weights(tmp_path / "ddp", tmp_path / "fsdp")
    # the final model is gathered whole: it loads on its own and scores what the run reported
    assert evaluate_saved(spec, tmp_path / "fsdp")["eval_accuracy"] == pytest.approx(final["eval_accuracy"])

    # rank 0's memory event: its shards, as estimated (a quarter of the model and a little padding)
    (memory,) = fsdp.of_kind("memory")
    estimate = estimate_memory(spec, num_labels=2)
    for part in ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes"):
        assert memory["values"][part] == getattr(estimate, part), part
    assert memory["values"]["parameter_bytes"] < ddp.of_kind("memory")[0]["values"]["parameter_bytes"] / 3

    # Checkpoints hold the shards. A run stopped after step 4 resumes from them on 2 ranks instead of 4
    # (the shards are re-split on load) and ends as the whole run did.
    out = tmp_path / "fsdp"
    assert [p.name for p in complete_checkpoints(out)] == ["checkpoint-4", "checkpoint-8"]
    assert len(list((out / "checkpoint-4" / SHARDED_DIR).glob("*.distcp"))) == 4  # one file per rank
    shutil.copytree(out, tmp_path / "reference")
    shutil.rmtree(out / "checkpoint-8")
    (out / "metrics.json").unlink()
    status, resumed = run(spec_for(tmp_path, "fsdp", 2), out, resume=True)
    assert status == "succeeded", done_event(resumed)
    assert norms(resumed) == pytest.approx(norms(fsdp)[4:], rel=1e-4)
    assert_same_weights(tmp_path / "reference", out)
