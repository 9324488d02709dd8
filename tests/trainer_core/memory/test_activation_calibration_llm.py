"""The causal-LM activation formula (LoRA branches, the fp32 logits and packed rows' mask included)
against what autograd keeps on the CPU, measured as in test_activation_calibration.py (SDPA without
dropout keeps no scores)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.trainer_core.memory.llm_models import build_llm
from trainer_core.data.packing import PackedCollator
from trainer_core.memory import estimate_memory
from trainer_core.memory.activations import estimate_activations
from trainer_core.memory.parameters import model_structure
from trainer_core.modeling import config_from_dict
from trainer_core.spec import parse_spec

B, S = 4, 128
LLAMA: dict[str, Any] = {
    "model_type": "llama", "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 2, "intermediate_size": 704, "vocab_size": 1000, "max_position_embeddings": 256,
}  # fmt: skip


def saved_storages(model: torch.nn.Module, batch: dict[str, torch.Tensor], precision: str) -> dict[int, int]:
    """Bytes of each storage autograd keeps for backward in one forward of ``batch``, parameters aside."""
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", enabled=precision == "bf16"),
    ):
        model(**batch)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return {ptr: n for ptr, n in storages.items() if ptr not in params}


@pytest.mark.parametrize("precision", ["no", "bf16"])
@pytest.mark.parametrize("adapter", [None, {"type": "lora", "r": 16, "dropout": 0.05}, {"type": "lora", "dropout": 0}])
def test_causal_lm_activations_match_saved_tensors(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, adapter: dict[str, Any] | None, precision: str
) -> None:
    from tests.trainer_core.memory import llm_models

    monkeypatch.setitem(llm_models.LLM_CONFIGS, "calibration", LLAMA)
    spec = parse_spec({
        "name": "calibration", "task": "causal-lm", "model": {"config": LLAMA}, "dataset": {"path": "json"},
        "preprocessing": {"max_length": S}, "training": {"per_device_train_batch_size": B},
        "efficiency": {"mixed_precision": precision}, "adapter": adapter,
    })  # fmt: skip
    parts = {p.name: p.bytes for p in estimate_memory(spec).parts}
    estimated = parts["activations"] + parts["autocast_copies"] + parts["logits_fp32"]
    model = build_llm(spec).train()
    ids = torch.randint(0, 1000, (B, S), generator=torch.Generator().manual_seed(0))
    saved = sum(saved_storages(model, {"input_ids": ids, "labels": ids}, precision).values())
    ratio = estimated / saved
    assert 0.8 <= ratio <= 1.15, f"{adapter} {precision}: estimate / saved = {ratio:.2f}"


@pytest.mark.parametrize("precision", ["no", "bf16"])
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_rows_cost_what_their_mask_adds(attn: str, precision: str) -> None:
    """What packed rows add over a plain batch of the same shape (their 4D mask; under SDPA each layer's
    converted copy and K/V repeated to every head) against what autograd keeps, plus the mask itself."""
    doc = {
        "name": "calibration", "task": "causal-lm", "model": {"config": LLAMA}, "dataset": {"path": "json"},
        "preprocessing": {"max_length": S}, "training": {"per_device_train_batch_size": B},
        "efficiency": {"mixed_precision": precision},
    }  # fmt: skip
    padded = parse_spec(doc)
    packed = parse_spec({**doc, "preprocessing": {"max_length": S, "packing": True}})
    structure = dataclasses.replace(model_structure(padded.model, "causal-lm", None), attn_implementation=attn)
    estimated = estimate_activations(structure, packed).bytes - estimate_activations(structure, padded).bytes

    model = AutoModelForCausalLM.from_config(config_from_dict(LLAMA), attn_implementation=attn).train()
    model.config.use_cache = False
    ids = torch.randint(0, 1000, (B, S), generator=torch.Generator().manual_seed(0)).tolist()
    halves = list(range(S // 2)) * 2  # two examples a row
    rows = PackedCollator(0, attn)([{"input_ids": r, "labels": r, "position_ids": halves} for r in ids])
    # The same rows unpacked, positions per row too (rotary's cos/sin are then per row in both).
    plain = {"input_ids": rows["input_ids"], "labels": rows["labels"], "position_ids": torch.arange(S).repeat(B, 1)}
    with_mask, without = saved_storages(model, rows, precision), saved_storages(model, plain, precision)
    mask = rows["attention_mask"].untyped_storage()
    held = 0 if mask.data_ptr() in with_mask else mask.nbytes()  # the batch holds it through backward
    measured = sum(with_mask.values()) - sum(without.values()) + held
    assert 0.9 <= estimated / measured <= 1.1, f"{attn} {precision}: estimated {estimated}, measured {measured}"
