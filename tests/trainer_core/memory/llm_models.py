"""Tiny Llama-, Qwen2- and GPT-2-shaped causal LMs built for real: full, with PEFT LoRA, or with a
bitsandbytes 4-bit base through transformers' ``BitsAndBytesConfig`` (which runs on the CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from trainer_core.modeling import config_from_dict
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

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "no": torch.float32}


def build_llm(arch: str, spec: JobSpec, tmp: Path) -> nn.Module:
    """The model ``spec`` describes, as a run would build it (seeded)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config_from_dict(dict(LLM_CONFIGS[arch])))
    adapter = spec.adapter
    if adapter is None:
        return model
    base_dtype = _DTYPES[spec.efficiency.mixed_precision]
    if adapter.type == "qlora":
        model.save_pretrained(tmp)
        quant = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=adapter.double_quant,
            bnb_4bit_compute_dtype=_DTYPES[adapter.compute_dtype],
        )  # fmt: skip
        model = AutoModelForCausalLM.from_pretrained(tmp, quantization_config=quant, dtype=base_dtype)
    else:
        model = model.to(base_dtype)
    config = LoraConfig(
        r=adapter.r, lora_alpha=adapter.alpha, lora_dropout=adapter.dropout,
        target_modules=adapter.target_modules, task_type="CAUSAL_LM",
    )  # fmt: skip
    return get_peft_model(model, config)


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of ``tensors``, each storage once (tied weights share one)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


def parameter_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter, and for 4-bit weights their quantisation state (absmax, codes, nested state)."""
    out: list[torch.Tensor] = []
    for param in model.parameters():
        out.append(param)
        state = getattr(param, "quant_state", None)
        if state is not None:
            out += [state.absmax, state.code]
            if state.nested:
                out += [state.offset, state.state2.absmax, state.state2.code]
    return out
