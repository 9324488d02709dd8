"""Sharded runs (``efficiency.sharding: fsdp``, issue 28) through the run itself: two processes under
torchrun (gloo), the accelerate backend. Each rank's bytes against the estimate, for every mode and world
size, are tests/trainer_core/memory/test_sharding_agreement.py's."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.trainer_core.runhelpers import assert_same_weights, done_event, evaluate_saved, run, text_spec
from trainer_core.checkpoint import complete_checkpoints
from trainer_core.memory import estimate_memory
from trainer_core.sharding import SHARDED_DIR
from trainer_core.spec import JobSpec

RUN = {"num_train_epochs": 2, "per_device_train_batch_size": 8, "learning_rate": 3e-3, "logging_steps": 1,
       "save_steps": 4, "eval_strategy": "epoch"}  # fmt: skip


def spec_for(tmp_path: Path, sharding: str) -> JobSpec:
    # 64 rows / (8 x 2 ranks): 4 steps an epoch, 8 in all; gradients clipped (max_grad_norm 1.0) each step
    return text_spec(
        tmp_path / "data", "accelerate", n_train=64, n_val=31, training=RUN,
        efficiency={"sharding": sharding}, resources={"num_processes": 2},
    )  # fmt: skip


def losses(events: Any) -> list[float]:
    return [e["values"]["loss"] for e in events.of_kind("metric")]


@pytest.mark.slow
def test_a_sharded_run_trains_as_ddp_does_and_resumes_from_its_shards(tmp_path: Path) -> None:
    status, ddp = run(spec_for(tmp_path, "none"), tmp_path / "ddp")
    assert status == "succeeded", done_event(ddp)
    spec = spec_for(tmp_path, "fsdp")
    status, fsdp = run(spec, tmp_path / "fsdp")
    assert status == "succeeded", done_event(fsdp)

    # the same training: loss at every step, gradient norms (clipped over the shards), evaluations
    assert losses(fsdp) == pytest.approx(losses(ddp), rel=1e-5)
    assert len(losses(fsdp)) == 8
    norms = [e["values"]["grad_norm"] for e in fsdp.of_kind("metric")]
    assert norms == pytest.approx([e["values"]["grad_norm"] for e in ddp.of_kind("metric")], rel=1e-4)
    final = done_event(fsdp)["summary"]["eval"]
    assert final["eval_loss"] == pytest.approx(done_event(ddp)["summary"]["eval"]["eval_loss"], rel=1e-5)
    # the final model is gathered whole: it loads on its own and scores what the run reported
    assert evaluate_saved(spec, tmp_path / "fsdp")["eval_accuracy"] == pytest.approx(final["eval_accuracy"])

    # rank 0's memory event: its shards, as estimated (half a model and a little padding)
    (memory,) = fsdp.of_kind("memory")
    estimate = estimate_memory(spec, num_labels=2)
    for part in ("parameter_bytes", "gradient_bytes", "optimizer_state_bytes"):
        assert memory["values"][part] == getattr(estimate, part), part
    assert memory["values"]["parameter_bytes"] < ddp.of_kind("memory")[0]["values"]["parameter_bytes"]

    # checkpoints hold the shards; a run killed after step 4 resumes from them and ends as the whole run did
    out = tmp_path / "fsdp"
    assert [p.name for p in complete_checkpoints(out)] == ["checkpoint-4", "checkpoint-8"]
    assert (out / "checkpoint-4" / SHARDED_DIR / ".metadata").is_file()
    shutil.copytree(out, tmp_path / "reference")
    shutil.rmtree(out / "checkpoint-8")
    (out / "metrics.json").unlink()
    status, resumed = run(spec, out, resume=True)
    assert status == "succeeded", done_event(resumed)
    assert losses(resumed) == pytest.approx(losses(fsdp)[4:], rel=1e-5)
    assert_same_weights(tmp_path / "reference", out)
