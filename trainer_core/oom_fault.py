"""A testing aid: an out-of-memory on demand, so the worker's smaller-configuration retry
(worker/oom_retry.py, with the ladder of ``trainer_core.memory.planner.next_oom_changes``) can be
driven on a CPU, and by the chaos and GPU scripts.

``TRAINJOBS_FAULT_OOM_ABOVE_MICROBATCH=N`` in a training process's environment raises
``torch.OutOfMemoryError`` on the first forward of a training micro-batch larger than ``N``. Unset,
nothing is installed.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

FAULT_OOM_ENV = "TRAINJOBS_FAULT_OOM_ABOVE_MICROBATCH"
# The input layers of every supported model: the first module a micro-batch meets in a forward.
_INPUT_LAYERS = (nn.Embedding, nn.Conv1d, nn.Conv2d)


@contextmanager
def oom_fault() -> Iterator[None]:
    """The testing fault for the block, when ``TRAINJOBS_FAULT_OOM_ABOVE_MICROBATCH`` is set (see module
    docstring). Removed when the block ends: the hook is process-wide, and one left behind failed every
    later run of the process (another test's in-process run, with the setting long gone)."""
    limit_text = os.environ.get(FAULT_OOM_ENV)
    if not limit_text:
        yield
        return
    limit = int(limit_text)

    def check(module: nn.Module, args: tuple[Any, ...]) -> None:
        # Training forwards only (evaluation runs in eval mode or without gradients).
        if not (isinstance(module, _INPUT_LAYERS) and module.training and torch.is_grad_enabled()):
            return
        if args and isinstance(args[0], torch.Tensor) and args[0].dim() > 0 and args[0].shape[0] > limit:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory (fault injected by {FAULT_OOM_ENV}={limit}: micro-batch {args[0].shape[0]})"
            )

    handle = nn.modules.module.register_module_forward_pre_hook(check)
    try:
        yield
    finally:
        handle.remove()
