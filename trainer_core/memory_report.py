"""The ``memory`` event: what the parameters, gradients and optimizer state of a live run really take.

Measured once, after the first optimizer step (optimizers allocate their state lazily on that step).
"""

from __future__ import annotations

import torch
from torch import nn

from trainer_core.events import Event, make_event
from trainer_core.torch_optim import optimizer_state_bytes


def _unique_parameters(model: nn.Module) -> list[nn.Parameter]:
    # Tied weights (embeddings shared with a head) share storage; count each storage once.
    seen: set[int] = set()
    params: list[nn.Parameter] = []
    for param in model.parameters():
        key = param.untyped_storage().data_ptr() or id(param)
        if key not in seen:
            seen.add(key)
            params.append(param)
    return params


def memory_values(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int | None]:
    """parameter, gradient (one per trainable parameter, same dtype) and optimizer-state bytes."""
    # Accelerate wraps optimizers; the state lives on the inner one.
    inner = getattr(optimizer, "optimizer", optimizer)
    params = _unique_parameters(model)
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    return {
        "parameter_bytes": sum(p.numel() * p.element_size() for p in params),
        # Gradients may already be freed (zero_grad(set_to_none)) when this runs; their size is fixed.
        "gradient_bytes": sum(p.numel() * p.element_size() for p in params if p.requires_grad),
        "optimizer_state_bytes": optimizer_state_bytes(inner),
        "peak_allocated_bytes": peak,
    }


def memory_event(model: nn.Module, optimizer: torch.optim.Optimizer) -> Event:
    """The ``memory`` event for ``model`` and its live ``optimizer``."""
    return make_event("memory", values=memory_values(model, optimizer))
