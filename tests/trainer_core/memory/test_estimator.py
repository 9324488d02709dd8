"""The estimate's parts add up, serialise, and follow devices, budget and overhead."""

from __future__ import annotations

import json

import pytest

from tests.trainer_core.memory.conftest import SpecFactory
from trainer_core.memory import MemoryEstimate, estimate_memory
from trainer_core.spec import ModelSpec, SpecError


def test_total_is_the_sum_of_parts_with_the_larger_phase(make_spec: SpecFactory) -> None:
    e = estimate_memory(make_spec("roberta-base", efficiency={"mixed_precision": "bf16"}))
    parts = {p.name: p.bytes for p in e.parts}
    phase = max(parts["activations"] + parts["autocast_copies"], parts["optimizer_step_temporary"])
    fixed = parts["parameters"] + parts["gradients"] + parts["optimizer_state"] + parts["overhead"]
    assert e.total_bytes == fixed + parts["ddp_buckets"] + phase
    assert parts["autocast_copies"] > 0 and e.transient_bytes > 0
    assert all(p.formula for p in e.parts)
    again = MemoryEstimate.model_validate(json.loads(json.dumps(e.model_dump(mode="json"))))
    assert again == e


def test_devices_budget_and_overhead(make_spec: SpecFactory) -> None:
    spec = make_spec("bert-base-uncased", resources={"num_processes": 2, "gpu_memory_gb": 4})
    two = estimate_memory(spec)
    assert two.devices == 2 and two.ddp_bucket_bytes == two.gradient_bytes
    one = estimate_memory(spec, devices=1)
    assert one.ddp_bucket_bytes == 0 and two.total_bytes - one.total_bytes == two.gradient_bytes
    assert two.gpu_memory_bytes == 4 * 1024**3 and two.fits is (two.total_bytes <= 4 * 1024**3)
    assert estimate_memory(spec, gpu_memory_gb=100).fits is True
    lean = estimate_memory(spec, overhead_bytes=0)
    assert two.total_bytes - lean.total_bytes == two.overhead_bytes == 1024**3


def test_overhead_from_environment(make_spec: SpecFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINJOBS_MEMORY_OVERHEAD_MB", "300")
    assert estimate_memory(make_spec("text")).overhead_bytes == 300 * 1024**2


def test_checkpointing_a_model_that_cannot_is_a_field_error(make_spec: SpecFactory) -> None:
    spec = make_spec("microsoft/resnet-50", task="image-classification",
                     efficiency={"gradient_checkpointing": True})  # fmt: skip
    with pytest.raises(SpecError) as info:
        estimate_memory(spec)
    assert info.value.errors[0].field == "efficiency.gradient_checkpointing"


def test_model_that_cannot_do_the_task_is_a_field_error(make_spec: SpecFactory) -> None:
    with pytest.raises(SpecError) as info:
        estimate_memory(make_spec("google/vit-base-patch16-224", task="text-classification"))
    assert info.value.errors[0].field == "task"
    assert "vit" in info.value.errors[0].message


def test_invalid_inline_config_is_a_field_error(make_spec: SpecFactory) -> None:
    bad_type = make_spec("text").model_copy(update={"model": ModelSpec(config={"model_type": "no-such-arch"})})
    with pytest.raises(SpecError) as info:
        estimate_memory(bad_type)
    assert info.value.errors[0].field == "model.config"
    uneven = ModelSpec(config={"model_type": "bert", "hidden_size": 30, "num_attention_heads": 4})
    with pytest.raises(SpecError) as info:
        estimate_memory(make_spec("text").model_copy(update={"model": uneven}))
    assert info.value.errors[0].field == "model.config"
