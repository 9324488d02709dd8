"""The optimizer-state estimate equals, to the byte, what the real optimizers allocate after a step."""

from __future__ import annotations

import pytest
import torch

from tests.trainer_core.memory.conftest import TINY_CONFIGS, SpecFactory, tiny_batch
from trainer_core.memory import estimate_memory
from trainer_core.memory.optimizer_state import optimizer_memory
from trainer_core.memory.parameters import model_structure
from trainer_core.modeling import MODEL_CLASSES, config_from_dict
from trainer_core.optimizers import OPTIMIZER_NAMES, build_optimizer
from trainer_core.spec import JobSpec
from trainer_core.torch_optim import optimizer_state_bytes


def measured_state_bytes(kind: str, spec: JobSpec, precision: str) -> int:
    """Build the real model and optimizer, take one step, and measure the optimizer's state."""
    task, config = TINY_CONFIGS[kind]
    torch.manual_seed(0)
    model = MODEL_CLASSES[task].from_config(config_from_dict(config))
    if precision == "bf16-weights":
        model = model.to(torch.bfloat16)
    optimizer = build_optimizer(model, spec.optimizer, 1e-3, 0.01)
    batch = tiny_batch(kind)
    if precision == "bf16-weights":
        batch = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in batch.items()}
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-autocast"):
        loss = model(**batch).loss
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"parameters without gradient would have no state: {missing}"
    optimizer.step()
    return optimizer_state_bytes(optimizer)


@pytest.mark.parametrize("kind", ["text", "image", "conv", "audio"])
@pytest.mark.parametrize("optimizer", OPTIMIZER_NAMES)  # every table entry: a new one is checked too
@pytest.mark.parametrize("precision", ["fp32", "bf16-autocast", "bf16-weights"])
def test_state_bytes_match_real_optimizer(make_spec: SpecFactory, kind: str, optimizer: str, precision: str) -> None:
    mixed = "bf16" if precision == "bf16-autocast" else "no"
    spec = make_spec(kind, optimizer={"name": optimizer}, efficiency={"mixed_precision": mixed})
    if precision == "bf16-weights":
        structure = model_structure(spec.model, spec.task)
        expected = optimizer_memory(structure.tensors, spec.optimizer, param_itemsize=2).state_bytes
    else:
        expected = estimate_memory(spec).optimizer_state_bytes
    assert measured_state_bytes(kind, spec, precision) == expected


@pytest.mark.parametrize(
    "optimizer", [{"name": "adamw", "amsgrad": True}, {"name": "adafactor", "adafactor_beta1": 0.9}]
)
def test_optional_moments_are_counted(make_spec: SpecFactory, optimizer: dict[str, object]) -> None:
    spec = make_spec("text", optimizer=optimizer)
    plain = make_spec("text", optimizer={"name": optimizer["name"]})
    estimate = estimate_memory(spec).optimizer_state_bytes
    assert measured_state_bytes("text", spec, "fp32") == estimate
    # the extra moment is one full fp32 copy of the trainable parameters
    assert estimate - estimate_memory(plain).optimizer_state_bytes == estimate_memory(spec).gradient_bytes


def test_8bit_state_is_smaller_and_mb_is_rounded(make_spec: SpecFactory) -> None:
    adamw = estimate_memory(make_spec("text"))
    eight = estimate_memory(make_spec("text", optimizer={"name": "adamw_8bit"}))
    assert eight.optimizer_state_bytes < adamw.optimizer_state_bytes
    assert adamw.optimizer_state_mb == round(adamw.optimizer_state_bytes / 1024**2)


def test_8bit_overrides_do_not_leak_between_optimizers(make_spec: SpecFactory) -> None:
    # bnb's process-wide manager once carried the text model's 32-bit embedding slots over to the
    # ViT built next (its patch projection then got 32-bit state); each optimizer now has its own.
    for kind in ("text", "image", "text"):
        spec = make_spec(kind, optimizer={"name": "adamw_8bit"})
        assert measured_state_bytes(kind, spec, "fp32") == estimate_memory(spec).optimizer_state_bytes, kind
