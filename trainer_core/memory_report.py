"""The ``memory`` event: what the parameters, gradients and optimizer state of a live run really take.

Measured once, after the first optimizer step (optimizers allocate their state lazily on that step).
"""

from __future__ import annotations

import torch
from torch import nn

from trainer_core.events import Event, make_event
from trainer_core.torch_optim import local, optimizer_state_bytes


def parameter_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter, and for bitsandbytes 4-bit weights their quantisation state (absmax, code
    book, nested statistics), which lives beside the packed ``Params4bit`` tensor."""
    out: list[torch.Tensor] = []
    for param in model.parameters():
        out.append(local(param))
        state = getattr(param, "quant_state", None)
        if state is not None:
            out += [state.absmax, state.code]
            if state.nested:
                out += [state.offset, state.state2.absmax, state.state2.code]
    return out


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of ``tensors``, each storage once (tied weights share one; a shard's padding counts)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr() or id(storage)] = storage.nbytes()
    return sum(seen.values())


def _gradient_bytes(param: torch.Tensor) -> int:
    shard = local(param)
    return shard.untyped_storage().nbytes() if shard is not param else param.numel() * param.element_size()


def memory_values(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int | None]:
    """parameter, gradient (one per trainable parameter, same dtype) and optimizer-state bytes."""
    # Accelerate wraps optimizers; the state lives on the inner one.
    inner = getattr(optimizer, "optimizer", optimizer)
    trainable = {id(p): p for p in model.parameters() if p.requires_grad}.values()
    peak = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None
    return {
        "parameter_bytes": storage_bytes(parameter_tensors(model)),
        # Gradients may already be freed (zero_grad(set_to_none)) when this runs; their size is fixed:
        # one per trainable parameter, and under FSDP one per shard, padded as the shard is (FSDP2
        # reduce-scatters into padded shards and keeps views of them as the gradients).
        "gradient_bytes": sum(_gradient_bytes(p) for p in trainable),
        "optimizer_state_bytes": optimizer_state_bytes(inner),
        "peak_allocated_bytes": peak,
    }


def memory_event(model: nn.Module, optimizer: torch.optim.Optimizer) -> Event:
    """The ``memory`` event for ``model`` and its live ``optimizer``."""
    return make_event("memory", values=memory_values(model, optimizer))
