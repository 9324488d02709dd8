"""Every optimizer trains on every backend, and the memory event reports the optimizer's real state."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.trainer_core import datagen
from tests.trainer_core.runhelpers import BACKENDS, done_event, logged_losses, memory_after_one_step, run, text_spec
from trainer_core.backends.common import build_training_model
from trainer_core.data import prepare_data
from trainer_core.optimizers import build_optimizer
from trainer_core.spec import JobSpec


def state_bytes_after_one_step(spec: JobSpec) -> tuple[int, int]:
    """(parameter bytes, optimizer-state bytes) of a freshly built model and optimizer after one step."""
    values = memory_after_one_step(spec, prepare_data(spec, None))
    return int(values["parameter_bytes"] or 0), int(values["optimizer_state_bytes"] or 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("optimizer", ["adamw", "adafactor", "adamw_8bit"])
def test_every_optimizer_lowers_the_loss_and_reports_its_state(tmp_path: Path, backend: str, optimizer: str) -> None:
    # One batch of 16 seen 20 times: the model memorises it, so the loss must fall clearly.
    spec = text_spec(
        tmp_path / "data", backend, n_train=16,
        # intermediate 128: the 32x128 feed-forward matrices reach bitsandbytes' 4096-element minimum
        # for 8-bit state (everything else in the tiny model stays 32-bit, embeddings by design).
        model={"config": {**datagen.TINY_BERT, "intermediate_size": 128}},
        optimizer={"name": optimizer},
        training={"max_steps": 20, "logging_steps": 4, "per_device_train_batch_size": 16,
                  "learning_rate": 1e-2 if optimizer == "adafactor" else 5e-3},
    )
    status, events = run(spec, tmp_path / "out")
    assert status == "succeeded", done_event(events)
    losses = logged_losses(events)
    assert len(losses) == 5
    assert losses[-1] < 0.7 * losses[0], losses

    memory = events.of_kind("memory")
    assert len(memory) == 1
    params, state = state_bytes_after_one_step(spec)
    values = memory[0]["values"]
    assert values["optimizer_state_bytes"] == state
    assert values["parameter_bytes"] == params
    assert values["gradient_bytes"] == params  # every parameter trains
    assert values["peak_allocated_bytes"] is None  # no CUDA here
    fp32_adam_state = 2 * params  # exp_avg + exp_avg_sq
    if optimizer == "adamw":
        assert state > fp32_adam_state
    elif optimizer == "adamw_8bit":
        assert state < fp32_adam_state  # some moments really are 8-bit
    else:
        assert state < fp32_adam_state / 4  # Adafactor keeps factored second moments only



def test_adamw_on_the_cpu_is_the_fused_kernel_and_matches_the_loop(tmp_path: Path) -> None:
    # What Trainer's default (adamw_torch_fused) picks; torch's CPU default is a per-tensor loop
    # several times slower. Same update: one step from the same gradients gives the same weights.
    spec = text_spec(tmp_path / "data", "accelerate", n_train=8)
    data = prepare_data(spec, None)
    models = [build_training_model(spec, data.labels) for _ in range(2)]
    fused, twin = (build_optimizer(m, spec.optimizer, 1e-2, 0.01) for m in models)
    assert fused.defaults["fused"] is True
    loop = torch.optim.AdamW([{**g, "fused": None, "foreach": False} for g in twin.param_groups], lr=1e-2)
    batch = data.collator([data.train[i] for i in range(4)])
    for model, optimizer in zip(models, (fused, loop), strict=True):
        torch.manual_seed(0)  # the same dropout masks
        model(**batch).loss.backward()
        optimizer.step()
    for a, b in zip(models[0].parameters(), models[1].parameters(), strict=True):
        torch.testing.assert_close(a, b)
