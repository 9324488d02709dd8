"""The optimizer registry: the one place that turns ``OptimizerSpec`` into a live optimizer.

Both backends and the memory estimator go through here, so what the estimator counts is exactly
what training allocates. Parameter groups follow ``Trainer``: no weight decay on biases and norms.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from trainer_core.spec import OptimizerSpec

# Same patterns as transformers' Trainer.get_decay_parameter_names.
_NO_DECAY_PATTERNS = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]
_NORM_TYPES: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d)

# bitsandbytes keeps tensors smaller than this in 32-bit state (its own default, spelled out here
# because the estimator depends on it).
BNB_MIN_8BIT_SIZE = 4096


def decay_parameter_names(model: nn.Module) -> set[str]:
    """Names of trainable parameters that get weight decay (not biases, not normalisation weights)."""
    names: set[str] = set()
    for mod_name, module in model.named_modules():
        if isinstance(module, _NORM_TYPES):
            continue
        for p_name, param in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if param.requires_grad and not any(re.search(p, full.lower()) for p in _NO_DECAY_PATTERNS):
                names.add(full)
    return names


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Two groups, decay and no-decay, each parameter once (tied weights appear once)."""
    decay = decay_parameter_names(model)
    with_decay: list[nn.Parameter] = []
    without: list[nn.Parameter] = []
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        (with_decay if name in decay else without).append(param)
    groups = [
        {"params": with_decay, "weight_decay": weight_decay},
        {"params": without, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def embedding_modules(model: nn.Module) -> Iterator[nn.Embedding]:
    """Embeddings, which trainjobs (like Trainer) keeps at 32-bit state under 8-bit Adam."""
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            yield module


def build_optimizer(
    model: nn.Module, spec: OptimizerSpec, learning_rate: float, weight_decay: float
) -> torch.optim.Optimizer:
    """Build the optimizer ``spec`` names over ``model``'s trainable parameters."""
    groups = parameter_groups(model, weight_decay)
    if spec.name == "adamw":
        return torch.optim.AdamW(
            groups,
            lr=learning_rate,
            betas=(spec.adam_beta1, spec.adam_beta2),
            eps=spec.adam_epsilon,
            amsgrad=spec.amsgrad,
        )
    if spec.name == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(
            groups,
            lr=None if spec.adafactor_relative_step else learning_rate,
            beta1=spec.adafactor_beta1,
            decay_rate=spec.adafactor_decay_rate,
            clip_threshold=spec.adafactor_clip_threshold,
            scale_parameter=spec.adafactor_scale_parameter,
            relative_step=spec.adafactor_relative_step,
            warmup_init=False,
        )
    if spec.name == "adamw_8bit":
        import bitsandbytes as bnb

        optimizer = bnb.optim.AdamW8bit(
            groups,
            lr=learning_rate,
            betas=(spec.adam_beta1, spec.adam_beta2),
            eps=spec.adam_epsilon,
            min_8bit_size=BNB_MIN_8BIT_SIZE,
        )
        # bnb's GlobalOptimManager is process-wide and keys overrides by (group, index): a second
        # optimizer in the same process would inherit the first one's 32-bit slots. Give each its own.
        manager = object.__new__(bnb.optim.GlobalOptimManager)
        manager.initialize()
        for module in embedding_modules(model):
            manager.register_module_override(module, "weight", {"optim_bits": 32})
        optimizer.mng = manager
        return optimizer
    raise ValueError(f"unknown optimizer {spec.name!r}")  # unreachable: the spec's Literal forbids it


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held in ``optimizer.state``: every tensor's numel x element size, each storage once."""
    seen: set[int] = set()
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if not isinstance(value, torch.Tensor):
                continue
            storage = value.untyped_storage()
            key = storage.data_ptr() if storage.data_ptr() else id(storage)
            if key in seen:
                continue
            seen.add(key)
            total += storage.nbytes()
    return total
