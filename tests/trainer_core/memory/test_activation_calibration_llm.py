"""The causal-LM activation formula (LoRA branches and the fp32 logits included) against what autograd
keeps on the CPU, measured as in test_activation_calibration.py (SDPA without dropout keeps no scores)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.trainer_core.memory.llm_models import build_llm
from trainer_core.memory import estimate_memory
from trainer_core.spec import parse_spec

B, S = 4, 128
LLAMA: dict[str, Any] = {
    "model_type": "llama", "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
    "num_key_value_heads": 2, "intermediate_size": 704, "vocab_size": 1000, "max_position_embeddings": 256,
}  # fmt: skip


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
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with (
        torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t),
        torch.autocast("cpu", enabled=precision == "bf16"),
    ):
        model(input_ids=ids, labels=ids)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = sum(n for ptr, n in storages.items() if ptr not in params)
    ratio = estimated / saved
    assert 0.8 <= ratio <= 1.15, f"{adapter} {precision}: estimate / saved = {ratio:.2f}"
