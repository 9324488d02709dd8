"""Tiny Llama-, Qwen2- and GPT-2-shaped causal LMs built for real by the engine (``trainer_core.adapters``):
full, with PEFT LoRA, or with a bitsandbytes 4-bit base (which runs on the CPU)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trainer_core.memory_report import parameter_tensors, storage_bytes
from trainer_core.spec import JobSpec

# intermediate 256: down_proj's lora_A (16 x 256) takes bnb's 8-bit path (>= 4096 elements), the rest 32-bit.
LLM_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {
        "model_type": "llama", "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 64,
    },
    "qwen2": {
        "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 64,
        "tie_word_embeddings": True,
    },
    "gpt2": {
        "model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 300, "n_positions": 64,
        "bos_token_id": 0, "eos_token_id": 0,
    },
}  # fmt: skip

def build_llm(spec: JobSpec) -> nn.Module:
    """The model ``spec`` describes, built by the engine's own code as a run builds it (seeded)."""
    from trainer_core.adapters import build_base_model, with_adapter
    from trainer_core.modeling import build_model

    torch.manual_seed(0)
    if spec.adapter is None:
        return build_model(spec.task, spec.model, [])
    return with_adapter(spec, build_base_model(spec, []), checkpointing=False)


__all__ = ["LLM_CONFIGS", "build_llm", "parameter_tensors", "storage_bytes"]
