"""The torch side of the optimizer table: parameter groups, 8-bit overrides and measured state.

Parameter groups follow ``Trainer``: no weight decay on biases and norms. The estimator reads the
same functions (through :mod:`trainer_core.memory.parameters`), so what it counts is what training builds.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

# Same patterns as transformers' Trainer.get_decay_parameter_names.
_NO_DECAY_PATTERNS = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]
_NORM_TYPES: tuple[type[nn.Module], ...] = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d)


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


def override_embeddings_to_32bit(optimizer: Any, model: nn.Module) -> None:
    """Give a bitsandbytes optimizer its own manager with 32-bit state for ``model``'s embeddings."""
    import bitsandbytes as bnb

    # bnb's GlobalOptimManager is process-wide and keys overrides by (group, index): a second
    # optimizer in the same process would inherit the first one's 32-bit slots. Give each its own.
    manager = object.__new__(bnb.optim.GlobalOptimManager)
    manager.initialize()
    for module in embedding_modules(model):
        manager.register_module_override(module, "weight", {"optim_bits": 32})
    optimizer.mng = manager


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of a sharded (FSDP2) tensor, with its padded storage; any other tensor itself."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held in ``optimizer.state`` on this process: each tensor's storage once (a shard's own)."""
    seen: set[int] = set()
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if not isinstance(value, torch.Tensor):
                continue
            storage = local(value).untyped_storage()
            key = storage.data_ptr() if storage.data_ptr() else id(storage)
            if key in seen:
                continue
            seen.add(key)
            total += storage.nbytes()
    return total
