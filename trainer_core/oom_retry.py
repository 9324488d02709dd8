"""A way out of an out-of-memory: the next smaller configuration, and a fault switch to test the path.

:func:`next_oom_changes` is what the worker applies before it requeues a job that ran out of device
memory. It keeps the effective batch (micro-batch x accumulation) and goes down the planner's ladder
one rung at a time: halve the micro-batch and double accumulation, then gradient checkpointing,
then a lighter optimizer (the planner's order of :data:`~trainer_core.spec.OPTIMIZERS`).

Testing aid: ``TRAINJOBS_FAULT_OOM_ABOVE_MICROBATCH=N`` in a training process's environment raises
``torch.OutOfMemoryError`` on the first forward of a training micro-batch larger than ``N``, so the
retry path can be driven on a CPU (and by the chaos and GPU scripts). Unset, nothing is installed.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from trainer_core.optimizers import planner_order
from trainer_core.spec import JobSpec

FAULT_OOM_ENV = "TRAINJOBS_FAULT_OOM_ABOVE_MICROBATCH"
# The input layers of every supported model: the first module a micro-batch meets in a forward.
_INPUT_LAYERS = (nn.Embedding, nn.Conv1d, nn.Conv2d)
_installed_limit: int | None = None  # the fault hook is process-wide, like the setting that asks for it


def next_oom_changes(spec: JobSpec) -> dict[str, Any] | None:
    """Spec changes (dotted paths) one rung below ``spec`` with the same effective batch; None at the bottom."""
    batch, accum = spec.training.per_device_train_batch_size, spec.efficiency.gradient_accumulation_steps
    if batch > 1 and batch % 2 == 0:
        return {"training.per_device_train_batch_size": batch // 2, "efficiency.gradient_accumulation_steps": accum * 2}
    if not spec.efficiency.gradient_checkpointing:
        return {"efficiency.gradient_checkpointing": True}
    order = planner_order()  # the optimizer table's order: lighter state further on
    lighter = order[order.index(spec.optimizer.name) + 1 :]
    return {"optimizer.name": lighter[0]} if lighter else None


def install_oom_fault() -> None:
    """Install the testing fault when ``TRAINJOBS_FAULT_OOM_ABOVE_MICROBATCH`` is set (see module docstring)."""
    limit_text = os.environ.get(FAULT_OOM_ENV)
    if not limit_text:
        return
    global _installed_limit
    limit = int(limit_text)
    if _installed_limit == limit:  # once per process: hooks are global
        return
    _installed_limit = limit

    def check(module: nn.Module, args: tuple[Any, ...]) -> None:
        # Training forwards only (evaluation runs in eval mode or without gradients).
        if not (isinstance(module, _INPUT_LAYERS) and module.training and torch.is_grad_enabled()):
            return
        if args and isinstance(args[0], torch.Tensor) and args[0].dim() > 0 and args[0].shape[0] > limit:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (fault injected by {FAULT_OOM_ENV}={limit}: micro-batch {args[0].shape[0]})"
            )

    nn.modules.module.register_module_forward_pre_hook(check)
