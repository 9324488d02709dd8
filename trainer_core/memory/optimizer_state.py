"""Optimizer state, per tensor, exactly as ``trainer_core.optimizers.build_optimizer`` allocates it.

The rules live with their optimizer in :data:`trainer_core.optimizers.OPTIMIZER_TABLE` (the module
docstring there names the implementation each was read from); this module applies them to a model
structure, optionally at another parameter dtype.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from trainer_core.optimizers import OptimizerMemory, OptimizerSpec, TensorInfo, optimizer_state

__all__ = ["OptimizerMemory", "optimizer_memory"]


def optimizer_memory(
    tensors: Sequence[TensorInfo], spec: OptimizerSpec, *, param_itemsize: int | None = None
) -> OptimizerMemory:
    """State bytes and step temporary of the optimizer ``spec`` names over ``tensors``.

    ``param_itemsize`` overrides the parameters' element size (e.g. 2 for a model cast to bf16).
    """
    if param_itemsize is not None:
        tensors = [dataclasses.replace(t, itemsize=param_itemsize) for t in tensors]
    return optimizer_state(tensors, spec)
