"""Efficiency settings: gradient checkpointing really on and loss-neutral, bf16 autocast, fp16 refused on CPU."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.trainer_core import datagen
from tests.trainer_core.runhelpers import (
    BACKENDS,
    NO_DROPOUT,
    assert_same_weights,
    done_event,
    logged_losses,
    run,
    text_spec,
)
from trainer_core.backends.common import build_training_model
from trainer_core.run import failure_reason, train_job
from trainer_core.spec import SpecError


def test_gradient_checkpointing_is_reported_on_by_the_model(tmp_path: Path) -> None:
    on = text_spec(tmp_path / "data", "accelerate", efficiency={"gradient_checkpointing": True})
    off = text_spec(tmp_path / "data", "accelerate")
    assert build_training_model(on, ["negative", "positive"]).is_gradient_checkpointing
    assert not build_training_model(off, ["negative", "positive"]).is_gradient_checkpointing


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_checkpointing_gives_the_same_losses_and_weights(tmp_path: Path, backend: str) -> None:
    results = {}
    for checkpointing in (False, True):
        spec = text_spec(
            tmp_path / "data", backend, n_train=32,
            model={"config": {**datagen.TINY_BERT, **NO_DROPOUT}},
            training={"max_steps": 4, "logging_steps": 1, "per_device_train_batch_size": 8},
            efficiency={"gradient_checkpointing": checkpointing},
        )
        status, events = run(spec, tmp_path / f"out-{checkpointing}")
        assert status == "succeeded"
        results[checkpointing] = logged_losses(events)
    assert len(results[True]) == 4
    assert results[True] == pytest.approx(results[False], abs=1e-5)
    assert_same_weights(tmp_path / "out-False", tmp_path / "out-True")


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_autocast_trains_end_to_end(tmp_path: Path, backend: str) -> None:
    losses = {}
    for precision in ("no", "bf16"):
        spec = text_spec(
            tmp_path / "data", backend, n_train=16,
            training={"max_steps": 12, "logging_steps": 3, "per_device_train_batch_size": 16,
                      "learning_rate": 5e-3},
            efficiency={"mixed_precision": precision},
        )
        status, events = run(spec, tmp_path / f"out-{precision}")
        assert status == "succeeded", done_event(events)
        losses[precision] = logged_losses(events)
    assert all(math.isfinite(x) for x in losses["bf16"])
    assert losses["bf16"][-1] < losses["bf16"][0]
    # Autocast really ran: bf16 matmuls round differently from fp32 ones.
    assert losses["bf16"] != losses["no"]
    assert losses["bf16"] == pytest.approx(losses["no"], abs=0.05)


def test_fp16_without_cuda_is_a_spec_error_suggesting_bf16(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    spec = text_spec(tmp_path / "data", "accelerate", efficiency={"mixed_precision": "fp16"})
    events: list[dict] = []
    with pytest.raises(SpecError) as info:
        train_job(spec, tmp_path / "out", emit=events.append)
    assert info.value.errors[0].field == "efficiency.mixed_precision"
    assert "bf16" in info.value.errors[0].message
    assert events[-1]["event"] == "done" and events[-1]["status"] == "failed"
    assert not (tmp_path / "out").exists()  # refused before anything ran


def test_out_of_memory_is_recognised_as_such() -> None:
    assert failure_reason(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")) == "out_of_memory"
    assert failure_reason(RuntimeError("DefaultCPUAllocator: can't allocate memory: out of memory")) == "out_of_memory"
    assert failure_reason(ValueError("shapes do not match")) == "internal"
