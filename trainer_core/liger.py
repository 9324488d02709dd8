"""``efficiency.liger``: Liger's Triton kernels patched into the model before training.

`liger-kernel <https://github.com/linkedin/Liger-Kernel>`_ (the ``liger`` extra) replaces a supported
model's RMSNorm, RoPE and SwiGLU with fused Triton kernels, and its loss with the fused linear
cross-entropy (the logits are never materialised: what :mod:`trainer_core.chunked_loss` does in plain
PyTorch). Triton kernels need a CUDA device: the spec refuses ``liger`` where none trains
(:func:`trainer_core.spec.untrainable_errors`; the API checks the queue's workers at submit).

The kernels go into the base model instance before an adapter wraps it, so LoRA layers wrap the same
Linears. Liger keeps the model's parameters, so the memory estimate's weights, gradients and optimizer
state are unchanged; its fused cross-entropy holds no logits, which the estimate's logits part follows.
"""

from __future__ import annotations

import logging

from torch import nn

from trainer_core.spec import FieldError, JobSpec, SpecError

logger = logging.getLogger(__name__)


def apply_liger(spec: JobSpec, model: nn.Module) -> None:
    """Patch Liger's kernels into ``model`` (a transformers causal LM) when the spec asks for them."""
    if not spec.efficiency.liger:
        return
    try:
        from liger_kernel.transformers import _apply_liger_kernel_to_instance
    except ImportError as exc:
        raise SpecError([FieldError(
            "efficiency.liger", "needs the liger-kernel package on the worker: pip install 'trainjobs[liger]'",
        )]) from exc  # fmt: skip
    _apply_liger_kernel_to_instance(model=model)
    logger.info("liger kernels applied to %s", type(model).__name__)
