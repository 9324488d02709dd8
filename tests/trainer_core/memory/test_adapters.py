"""Full, LoRA and QLoRA causal LMs: estimated parameters, gradients and optimizer state equal, to the
byte, what the real model (PEFT, bitsandbytes 4-bit) and a real optimizer step hold on the CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer_core.memory.llm_models import LLM_CONFIGS, build_llm, parameter_tensors, storage_bytes
from trainer_core.memory import estimate_memory
from trainer_core.memory.adapters import nf4_bytes
from trainer_core.optimizers import OPTIMIZER_NAMES, build_optimizer
from trainer_core.spec import JobSpec, SpecError, parse_spec

ADAPTERS: dict[str, dict[str, Any] | None] = {
    "full": None,
    "lora": {"type": "lora", "r": 16, "alpha": 32, "dropout": 0.05},
    "qlora": {"type": "qlora", "r": 16, "alpha": 32, "dropout": 0.05},
}


def llm_spec(arch: str, adapter: dict[str, Any] | None, optimizer: str = "adamw", mixed: str = "no") -> JobSpec:
    return parse_spec(
        {
            "name": "llm", "task": "causal-lm", "model": {"config": dict(LLM_CONFIGS[arch])},
            "dataset": {"path": "json"}, "adapter": adapter, "optimizer": {"name": optimizer},
            "efficiency": {"mixed_precision": mixed}, "preprocessing": {"max_length": 16},
        }
    )  # fmt: skip


def measure(arch: str, spec: JobSpec, tmp: Path) -> tuple[int, int, int, int]:
    """(parameter bytes, trainable numel, gradient bytes, optimizer state bytes) after one real step."""
    from trainer_core.torch_optim import optimizer_state_bytes

    model = build_llm(spec)
    params = storage_bytes(parameter_tensors(model))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(model, spec.optimizer, 1e-3, 0.01)
    ids = torch.randint(0, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    mixed = spec.efficiency.mixed_precision
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed == "bf16"):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert all(p.grad is not None for p in trainable)
    grads = storage_bytes([p.grad for p in trainable if p.grad is not None])
    optimizer.step()
    return params, sum(p.numel() for p in trainable), grads, optimizer_state_bytes(optimizer)


@pytest.mark.parametrize("arch", sorted(LLM_CONFIGS))
@pytest.mark.parametrize("kind", sorted(ADAPTERS))
@pytest.mark.parametrize("optimizer", OPTIMIZER_NAMES)
def test_parameters_gradients_and_state_match_a_real_step(tmp_path: Path, arch: str, kind: str, optimizer: str) -> None:
    spec = llm_spec(arch, ADAPTERS[kind], optimizer)
    estimate = estimate_memory(spec)
    params, trainable, grads, state = measure(arch, spec, tmp_path)
    assert (estimate.parameter_bytes, estimate.trainable_parameters) == (params, trainable)
    assert (estimate.gradient_bytes, estimate.optimizer_state_bytes) == (grads, state)


@pytest.mark.parametrize("arch", sorted(LLM_CONFIGS))
@pytest.mark.parametrize("adapter", [ADAPTERS["lora"], {**ADAPTERS["qlora"], "double_quant": False}])
def test_a_16_bit_frozen_base_matches_too(tmp_path: Path, arch: str, adapter: dict[str, Any]) -> None:
    spec = llm_spec(arch, adapter, "adamw_8bit", mixed="bf16")
    estimate = estimate_memory(spec)
    params, trainable, grads, state = measure(arch, spec, tmp_path)
    assert (estimate.parameter_bytes, estimate.gradient_bytes, estimate.optimizer_state_bytes) == (params, grads, state)
    assert estimate.trainable_parameters == trainable


def test_adapters_shrink_what_is_trained_and_qlora_the_base() -> None:
    full, lora, qlora = (estimate_memory(llm_spec("llama", ADAPTERS[k])) for k in ("full", "lora", "qlora"))
    assert lora.trainable_parameters < full.trainable_parameters // 2
    assert lora.gradient_bytes == 4 * lora.trainable_parameters  # trainable parameters only, fp32
    assert lora.parameter_bytes == full.parameter_bytes + lora.gradient_bytes  # fp32 base + fp32 adapters
    assert qlora.parameter_bytes < lora.parameter_bytes
    lora16 = estimate_memory(llm_spec("llama", ADAPTERS["lora"], mixed="bf16"))
    assert lora16.parameter_bytes == full.parameter_bytes // 2 + lora.gradient_bytes  # frozen base in bf16


def test_nf4_bytes_per_layer() -> None:
    # a 64 x 64 weight: 2048 packed bytes, 64 blocks of 64; fp32 absmax or uint8 + one nested fp32 block
    assert nf4_bytes(4096, double_quant=False) == 2048 + 64 * 4 + 64
    assert nf4_bytes(4096, double_quant=True) == 2048 + 64 + 4 + 64 + 1024 + 4


def test_target_modules_that_match_nothing_name_the_field() -> None:
    spec = llm_spec("llama", {"type": "lora", "target_modules": ["query", "value"]})
    with pytest.raises(SpecError) as info:
        estimate_memory(spec)
    (error,) = info.value.errors
    assert error.field == "adapter.target_modules" and "q_proj" in error.message
    named = estimate_memory(llm_spec("llama", {"type": "lora", "r": 8, "target_modules": ["q_proj", "v_proj"]}))
    assert named.trainable_parameters == 2 * 8 * ((64 + 64) + (64 + 32))  # 2 layers, q: 64->64, v: 64->32


def test_causal_lm_counts_the_fp32_logits() -> None:
    estimate = estimate_memory(llm_spec("llama", None))
    (part,) = [p for p in estimate.parts if p.name == "logits_fp32"]
    assert part.bytes == 8 * 16 * 300 * 4  # b x s x vocab x 4 B


@pytest.mark.parametrize("kind", ["text", "image"])
@pytest.mark.parametrize("optimizer", ["adamw", "adamw_8bit"])
def test_lora_on_classification_trains_a_copy_of_the_head(kind: str, optimizer: str) -> None:
    from peft import LoraConfig, get_peft_model

    from tests.trainer_core.memory.conftest import TINY_CONFIGS, tiny_batch
    from trainer_core.modeling import MODEL_CLASSES, config_from_dict
    from trainer_core.torch_optim import optimizer_state_bytes

    task, config = TINY_CONFIGS[kind]
    doc = {"name": "cls", "task": task, "model": {"config": dict(config)}, "dataset": {"path": "csv"}}
    spec = parse_spec({**doc, "adapter": {"type": "lora", "r": 8}, "optimizer": {"name": optimizer}})
    estimate = estimate_memory(spec)
    torch.manual_seed(0)
    base = MODEL_CLASSES[task].from_config(config_from_dict(dict(config)))
    lora = LoraConfig(r=8, lora_alpha=32, lora_dropout=0.05, target_modules="all-linear", task_type="SEQ_CLS")
    model = get_peft_model(base, lora)
    trainable = [p for p in model.parameters() if p.requires_grad]
    state = build_optimizer(model, spec.optimizer, 1e-3, 0.01)
    model(**tiny_batch(kind)).loss.backward()
    state.step()
    assert estimate.parameter_bytes == storage_bytes(parameter_tensors(model))
    assert estimate.trainable_parameters == sum(p.numel() for p in trainable)
    assert estimate.optimizer_state_bytes == optimizer_state_bytes(state)
