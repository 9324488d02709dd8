"""Gradient accumulation: batch 8 x 2 equals batch 16 x 1, and optimizer steps are counted right."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer_core import datagen
from tests.trainer_core.runhelpers import BACKENDS, NO_DROPOUT, done_event, run, text_spec, weights

ATOL = 1e-6


def one_step_spec(data: Path, backend: str, batch: int, accumulation: int) -> Any:
    return text_spec(
        data, backend, n_train=32,
        model={"config": {**datagen.TINY_BERT, **NO_DROPOUT}},
        # Adam's first step is lr * g / (|g| + eps): with eps = 1 it is a plain gradient step, so the
        # weights compare the gradients themselves (a tiny eps would blow float noise up to whole steps).
        optimizer={"name": "adamw", "adam_epsilon": 1.0},
        training={"max_steps": 1, "per_device_train_batch_size": batch, "learning_rate": 1.0,
                  "max_grad_norm": 0.0},
        efficiency={"gradient_accumulation_steps": accumulation},
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_accumulating_two_batches_of_8_equals_one_batch_of_16(tmp_path: Path, backend: str) -> None:
    outputs = {}
    for batch, accumulation in ((16, 1), (8, 2), (8, 1)):
        spec = one_step_spec(tmp_path / "data", backend, batch, accumulation)
        status, events = run(spec, tmp_path / f"out-{batch}x{accumulation}")
        assert status == "succeeded"
        assert done_event(events)["summary"]["global_step"] == 1
        outputs[(batch, accumulation)] = weights(tmp_path / f"out-{batch}x{accumulation}")
    big, accumulated, small = outputs[(16, 1)], outputs[(8, 2)], outputs[(8, 1)]
    for name in big:
        torch.testing.assert_close(accumulated[name], big[name], atol=ATOL, rtol=1e-5)
    # The comparison can tell a difference: the gradient of half the data gives weights far outside
    # its tolerance (the 8 longest inputs go first, a half of the 16 the big batch starts with).
    assert max((small[n] - big[n]).abs().max().item() for n in big) > 10 * ATOL


@pytest.mark.parametrize("backend", BACKENDS)
def test_optimizer_steps_count_a_partial_accumulation_at_epoch_end(tmp_path: Path, backend: str) -> None:
    # 56 rows / batch 8 = 7 batches per epoch; accumulation 2 -> 4 optimizer steps per epoch.
    spec = text_spec(
        tmp_path / "data", backend, n_train=56,
        training={"num_train_epochs": 2, "per_device_train_batch_size": 8, "logging_steps": 1,
                  "eval_strategy": "no"},
        efficiency={"gradient_accumulation_steps": 2},
    )
    status, events = run(spec, tmp_path / "out")
    assert status == "succeeded"
    steps = [e["step"] for e in events.of_kind("progress")]
    assert steps == list(range(1, 9))
    assert {e["total_steps"] for e in events.of_kind("progress")} == {8}
    assert done_event(events)["summary"]["global_step"] == 8
