"""The activation formula agrees with what autograd really keeps, measured on the CPU.

``torch.autograd.graph.saved_tensors_hooks`` sees every tensor the forward saves for backward; their
storages (parameters excluded, autocast's 16-bit weight copies included) are the activation memory of
the micro-batch. Compared only where the CPU runs the same kind of attention kernel as CUDA: SDPA
without attention dropout, which keeps no score matrix (with dropout the CPU falls back to the math
path and stores scores, where CUDA's kernels do not). The GPU check is bench/gpu_check.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from trainer_core.memory import estimate_memory
from trainer_core.modeling import build_model
from trainer_core.spec import JobSpec, parse_spec

B, S = 4, 128
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("text-classification", {
        "model_type": "llama", "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 2, "intermediate_size": 704, "vocab_size": 1000, "pad_token_id": 0,
    }),
    "vit": ("image-classification", {
        "model_type": "vit", "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
        "intermediate_size": 1024, "image_size": 224, "patch_size": 16,
    }),
    "bert": ("text-classification", {
        "model_type": "bert", "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
        "intermediate_size": 1024, "vocab_size": 1000, "attention_probs_dropout_prob": 0.0,
    }),
}  # fmt: skip


def saved_activation_bytes(spec: JobSpec) -> int:
    """Bytes of the distinct non-parameter storages the forward saves for backward."""
    torch.manual_seed(0)
    model = build_model(spec.task, spec.model, ["a", "b"]).train()
    labels = torch.zeros(B, dtype=torch.long)
    if spec.task == "text-classification":
        ids = torch.randint(0, 1000, (B, S))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    else:
        batch = {"pixel_values": torch.randn(B, 3, 224, 224), "labels": labels}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    bf16 = spec.efficiency.mixed_precision == "bf16"
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", enabled=bf16):
        model(**batch)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    return sum(n for ptr, n in storages.items() if ptr not in params)


@pytest.mark.parametrize("precision", ["no", "bf16"])
@pytest.mark.parametrize("kind", sorted(CASES))
def test_activation_estimate_matches_saved_tensors(kind: str, precision: str) -> None:
    task, config = CASES[kind]
    spec = parse_spec({
        "name": "calibration", "task": task, "model": {"config": config}, "dataset": {"path": "csv"},
        "preprocessing": {"max_length": S}, "training": {"per_device_train_batch_size": B},
        "efficiency": {"mixed_precision": precision},
    })  # fmt: skip
    estimate = estimate_memory(spec)
    parts = {p.name: p.bytes for p in estimate.parts}
    estimated = parts["activations"] + parts["autocast_copies"]
    ratio = estimated / saved_activation_bytes(spec)
    assert 0.8 <= ratio <= 1.15, f"{kind} {precision}: estimate / saved = {ratio:.2f}"
