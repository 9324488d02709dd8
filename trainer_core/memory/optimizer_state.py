"""Optimizer state, per tensor, exactly as ``trainer_core.optimizers.build_optimizer`` allocates it.

Each formula below was read from the installed implementation and checked byte for byte against
``trainer_core.optimizers.optimizer_state_bytes`` after a real step (tests/trainer_core/memory):

* torch AdamW (torch 2.13, ``torch/optim/adam.py::_init_group``): ``exp_avg`` and ``exp_avg_sq``
  ``zeros_like(param)`` (the parameter's dtype), ``max_exp_avg_sq`` too with amsgrad, and ``step``, a
  0-dim fp32 tensor (4 bytes; on the CPU unless fused/capturable, but ``optimizer.state`` holds it).
* transformers Adafactor (5.24, ``optimization.py``): state follows ``grad.float()``, so always fp32.
  Tensors with >= 2 dims keep ``exp_avg_sq_row`` (shape[:-1]) and ``exp_avg_sq_col``
  (shape[:-2] + shape[-1:]); vectors keep a full ``exp_avg_sq``; ``exp_avg`` (full) only when
  ``beta1`` is set; ``RMS`` is a 0-dim fp32 tensor per parameter (4 bytes); ``step`` is a Python int.
* bitsandbytes AdamW8bit (0.50, ``optim/optimizer.py::Optimizer2State.init_state``): tensors with
  >= ``min_8bit_size`` (4096) elements that are not overridden to 32-bit keep ``state1``/``state2``
  as uint8 plus ``absmax1``/``absmax2`` fp32 with one value per block of 256 elements; other tensors
  (and nn.Embedding weights, which trainjobs overrides to 32-bit as ``Trainer`` does) keep two fp32
  states whatever the parameter's dtype. The two 256-entry fp32 quantisation maps (``qmap1`` =
  signed dynamic map, ``qmap2`` = unsigned) are shared by every 8-bit tensor, so counted once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from trainer_core.memory.parameters import TensorInfo
from trainer_core.optimizers import BNB_MIN_8BIT_SIZE
from trainer_core.spec import OptimizerSpec

FP32 = 4
SCALAR_TENSOR_BYTES = 4  # AdamW's `step` and Adafactor's `RMS`: 0-dim fp32 tensors
BNB_BLOCK_SIZE = 256  # bnb 0.50 hard-codes 256-element blocks for the 8-bit blockwise state
BNB_QMAP_BYTES = 2 * 256 * FP32  # create_dynamic_map(signed=True/False): 256 fp32 values each


@dataclass(frozen=True)
class OptimizerMemory:
    """Optimizer state and the largest temporary its step allocates."""

    state_bytes: int
    state_formula: str
    step_temporary_bytes: int
    step_temporary_formula: str


def _adamw(tensors: Sequence[TensorInfo], spec: OptimizerSpec, itemsize: int | None) -> OptimizerMemory:
    moments = 3 if spec.amsgrad else 2
    state = sum(moments * t.numel * (itemsize or t.itemsize) + SCALAR_TENSOR_BYTES for t in tensors)
    # CUDA uses the foreach implementation by default: `_foreach_sqrt(exp_avg_sqs)` allocates a
    # full-size copy of one parameter group (decay or no-decay) at a time.
    groups = [sum(t.numel * (itemsize or t.itemsize) for t in tensors if t.decay is d) for d in (True, False)]
    moment_names = "exp_avg + exp_avg_sq" + (" + max_exp_avg_sq" if spec.amsgrad else "")
    return OptimizerMemory(
        state_bytes=state,
        state_formula=f"sum over tensors: {moments} x numel x param bytes ({moment_names}) + 4 B step",
        step_temporary_bytes=max(groups),
        step_temporary_formula="foreach sqrt(exp_avg_sq) of the larger parameter group (numel x param bytes)",
    )


def _adafactor_tensor_bytes(t: TensorInfo, first_moment: bool) -> int:
    if len(t.shape) >= 2:
        rows = math.prod(t.shape[:-1])
        cols = math.prod(t.shape[:-2]) * t.shape[-1]
        second = (rows + cols) * FP32
    else:
        second = t.numel * FP32
    return second + (t.numel * FP32 if first_moment else 0) + SCALAR_TENSOR_BYTES


def _adafactor(tensors: Sequence[TensorInfo], spec: OptimizerSpec) -> OptimizerMemory:
    first = spec.adafactor_beta1 is not None
    largest = max((t.numel for t in tensors), default=0)
    # step(): `update = grad**2 + eps` (full size) is alive while `_approx_sq_grad` builds the next
    # full-size product, and `-update` coexists with `update`: two fp32 copies of the largest tensor.
    # 16-bit parameters add `grad.float()` and `p.float()` copies (not the case with fp32 masters).
    extra = 2 if any(t.itemsize != FP32 for t in tensors) else 0
    return OptimizerMemory(
        state_bytes=sum(_adafactor_tensor_bytes(t, first) for t in tensors),
        state_formula=(
            "sum over tensors: 4 B x (rows + cols) if ndim >= 2 else 4 B x numel"
            + (" + 4 B x numel (exp_avg)" if first else "")
            + " + 4 B RMS"
        ),
        step_temporary_bytes=(2 + extra) * largest * FP32,
        step_temporary_formula="2 x 4 B x numel of the largest tensor (update and -update)",
    )


def _adamw_8bit(tensors: Sequence[TensorInfo], itemsize: int | None) -> OptimizerMemory:
    del itemsize  # bnb's 32-bit state is fp32 whatever the parameter dtype
    state = 0
    any_8bit = False
    for t in tensors:
        if t.numel >= BNB_MIN_8BIT_SIZE and not t.embedding:
            blocks = math.ceil(t.numel / BNB_BLOCK_SIZE)
            state += 2 * t.numel + 2 * blocks * FP32
            any_8bit = True
        else:
            state += 2 * t.numel * FP32
    state += BNB_QMAP_BYTES if any_8bit else 0
    return OptimizerMemory(
        state_bytes=state,
        state_formula=(
            f"8-bit tensors (numel >= {BNB_MIN_8BIT_SIZE}, not embeddings): 2 x numel x 1 B + "
            f"2 x 4 B x ceil(numel / {BNB_BLOCK_SIZE}); others: 2 x 4 B x numel; + 2 KiB shared qmaps"
        ),
        # bnb's CUDA kernels update state and parameters in place, block by block.
        step_temporary_bytes=0,
        step_temporary_formula="in-place fused kernel: none",
    )


def optimizer_memory(
    tensors: Sequence[TensorInfo], spec: OptimizerSpec, *, param_itemsize: int | None = None
) -> OptimizerMemory:
    """State bytes and step temporary of the optimizer ``spec`` names over ``tensors``.

    ``param_itemsize`` overrides the parameters' element size (e.g. 2 for a model cast to bf16).
    """
    if spec.name == "adamw":
        return _adamw(tensors, spec, param_itemsize)
    if spec.name == "adafactor":
        if param_itemsize is not None:
            tensors = [TensorInfo(**{**t.__dict__, "itemsize": param_itemsize}) for t in tensors]
        return _adafactor(tensors, spec)
    if spec.name == "adamw_8bit":
        return _adamw_8bit(tensors, param_itemsize)
    raise ValueError(f"unknown optimizer {spec.name!r}")  # unreachable: the spec's Literal forbids it
