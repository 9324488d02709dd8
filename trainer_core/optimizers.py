"""The optimizer table: one :class:`OptimizerEntry` per optimizer, the only place that knows them.

An entry holds the optimizer's name, the ``optimizer.*`` spec fields that apply to it, its builder,
its state-size rule and its rank in the memory planner. The spec (:class:`OptimizerSpec` below and
``trainer_core.spec``), both backends, ``memory/optimizer_state.py``, the planner and the estimator's
memo key all read :data:`OPTIMIZER_TABLE`; adding an optimizer is one entry plus its tests.

This module imports neither torch nor the rest of the spec, so the API can validate specs without
loading torch; builders import what they need when they run.

State rules, each read from the installed implementation and checked byte for byte against
``trainer_core.torch_optim.optimizer_state_bytes`` after a real step (tests/trainer_core/memory):

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
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, model_validator

from trainer_core.spec_base import StrictModel, combination_error

if TYPE_CHECKING:  # torch is imported by the builders when they run, never by the spec
    import torch
    from torch import nn

FP32 = 4
SCALAR_TENSOR_BYTES = 4  # AdamW's `step` and Adafactor's `RMS`: 0-dim fp32 tensors
# bitsandbytes keeps tensors smaller than this in 32-bit state (its own default, spelled out here
# because the state rule depends on it).
BNB_MIN_8BIT_SIZE = 4096
BNB_BLOCK_SIZE = 256  # bnb 0.50 hard-codes 256-element blocks for the 8-bit blockwise state
BNB_QMAP_BYTES = 2 * 256 * FP32  # create_dynamic_map(signed=True/False): 256 fp32 values each


@dataclass(frozen=True)
class TensorInfo:
    """One trainable parameter as the optimizer sees it."""

    name: str
    shape: tuple[int, ...]
    numel: int
    itemsize: int  # bytes per element at the dtype training builds the model in
    decay: bool  # in the weight-decay parameter group
    embedding: bool  # an nn.Embedding weight: bnb keeps its state at 32-bit
    autocast: bool  # cast to a 16-bit copy under autocast (Linear / Conv weights and biases)


@dataclass(frozen=True)
class OptimizerMemory:
    """Optimizer state and the largest temporary its step allocates."""

    state_bytes: int
    state_formula: str
    step_temporary_bytes: int
    step_temporary_formula: str


Builder = Callable[[list[dict[str, Any]], "OptimizerSpec", float, "nn.Module"], "torch.optim.Optimizer"]
StateRule = Callable[[Sequence[TensorInfo], "OptimizerSpec"], OptimizerMemory]


@dataclass(frozen=True)
class OptimizerEntry:
    """Everything trainjobs knows about one optimizer.

    ``fields``: the ``optimizer.*`` spec fields that apply (others must keep their defaults);
    ``state_fields``: those the state rule reads (the estimator's memo key);
    ``plan_rank``: the planner's order among equally fast plans (lower = less work per step).
    """

    name: str
    fields: frozenset[str]
    state_fields: tuple[str, ...]
    plan_rank: int
    build: Builder
    state: StateRule


# ---- builders: parameter groups in, live optimizer out -------------------------------------------


def _build_adamw(
    groups: list[dict[str, Any]], spec: OptimizerSpec, lr: float, model: nn.Module
) -> torch.optim.Optimizer:
    import torch

    betas = (spec.adam_beta1, spec.adam_beta2)
    # On the CPU torch's default is the single-tensor loop (~10 kernels per parameter); the fused
    # kernel, which Trainer's default `adamw_torch_fused` picks, took the optimizer step of the
    # MiniLM bench from ~17% of a step to a few %. CUDA keeps torch's default (foreach): the memory
    # rule below counts its step temporary, and the GPU check measures that.
    fused = True if not torch.cuda.is_available() else None
    return torch.optim.AdamW(
        groups, lr=lr, betas=betas, eps=spec.adam_epsilon, amsgrad=spec.amsgrad, fused=fused
    )


def _build_adafactor(
    groups: list[dict[str, Any]], spec: OptimizerSpec, lr: float, model: nn.Module
) -> torch.optim.Optimizer:
    from transformers.optimization import Adafactor

    return Adafactor(
        groups,
        lr=None if spec.adafactor_relative_step else lr,
        beta1=spec.adafactor_beta1,
        decay_rate=spec.adafactor_decay_rate,
        clip_threshold=spec.adafactor_clip_threshold,
        scale_parameter=spec.adafactor_scale_parameter,
        relative_step=spec.adafactor_relative_step,
        warmup_init=False,
    )


def _build_adamw_8bit(
    groups: list[dict[str, Any]], spec: OptimizerSpec, lr: float, model: nn.Module
) -> torch.optim.Optimizer:
    import bitsandbytes as bnb

    from trainer_core.torch_optim import override_embeddings_to_32bit

    betas = (spec.adam_beta1, spec.adam_beta2)
    optimizer = bnb.optim.AdamW8bit(groups, lr=lr, betas=betas, eps=spec.adam_epsilon, min_8bit_size=BNB_MIN_8BIT_SIZE)
    override_embeddings_to_32bit(optimizer, model)
    return optimizer  # type: ignore[no-any-return]


# ---- state rules: parameter shapes in, bytes out (see the module docstring for the sources) -------


def _adamw_state(tensors: Sequence[TensorInfo], spec: OptimizerSpec) -> OptimizerMemory:
    moments = 3 if spec.amsgrad else 2
    state = sum(moments * t.numel * t.itemsize + SCALAR_TENSOR_BYTES for t in tensors)
    # CUDA uses the foreach implementation by default: `_foreach_sqrt(exp_avg_sqs)` allocates a
    # full-size copy of one parameter group (decay or no-decay) at a time.
    groups = [sum(t.numel * t.itemsize for t in tensors if t.decay is d) for d in (True, False)]
    moment_names = "exp_avg + exp_avg_sq" + (" + max_exp_avg_sq" if spec.amsgrad else "")
    return OptimizerMemory(
        state_bytes=state,
        state_formula=f"sum over tensors: {moments} x numel x param bytes ({moment_names}) + 4 B step",
        step_temporary_bytes=max(groups),
        step_temporary_formula="foreach sqrt(exp_avg_sq) of the larger parameter group (numel x param bytes)",
    )


def _adafactor_tensor_bytes(t: TensorInfo, first_moment: bool) -> int:
    if len(t.shape) >= 2:
        second = (math.prod(t.shape[:-1]) + math.prod(t.shape[:-2]) * t.shape[-1]) * FP32
    else:
        second = t.numel * FP32
    return second + (t.numel * FP32 if first_moment else 0) + SCALAR_TENSOR_BYTES


def _adafactor_state(tensors: Sequence[TensorInfo], spec: OptimizerSpec) -> OptimizerMemory:
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


def _adamw_8bit_state(tensors: Sequence[TensorInfo], spec: OptimizerSpec) -> OptimizerMemory:
    state = 0
    any_8bit = False
    for t in tensors:  # 32-bit state is fp32 whatever the parameter dtype
        if t.numel >= BNB_MIN_8BIT_SIZE and not t.embedding:
            state += 2 * t.numel + 2 * math.ceil(t.numel / BNB_BLOCK_SIZE) * FP32
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


# ---- the table -----------------------------------------------------------------------------------

_ADAM_FIELDS = frozenset({"adam_beta1", "adam_beta2", "adam_epsilon"})
_ADAFACTOR_FIELDS = frozenset(
    {"adafactor_beta1", "adafactor_decay_rate", "adafactor_clip_threshold",
     "adafactor_scale_parameter", "adafactor_relative_step"}
)  # fmt: skip

# The spec's default first. plan_rank: adamw, then adamw_8bit (quantisation work), then adafactor
# (factored second moment: the most extra work per step).
OPTIMIZER_TABLE: Mapping[str, OptimizerEntry] = {
    entry.name: entry
    for entry in (
        OptimizerEntry(
            name="adamw", fields=_ADAM_FIELDS | {"amsgrad"}, state_fields=("amsgrad",), plan_rank=0,
            build=_build_adamw, state=_adamw_state,
        ),
        OptimizerEntry(
            name="adafactor", fields=_ADAFACTOR_FIELDS, state_fields=("adafactor_beta1",), plan_rank=2,
            build=_build_adafactor, state=_adafactor_state,
        ),
        OptimizerEntry(
            name="adamw_8bit", fields=_ADAM_FIELDS, state_fields=(), plan_rank=1,
            build=_build_adamw_8bit, state=_adamw_8bit_state,
        ),
    )
}  # fmt: skip
OPTIMIZER_NAMES: tuple[str, ...] = tuple(OPTIMIZER_TABLE)

if TYPE_CHECKING:
    OptimizerName = str  # mypy needs a literal list spelled out; at runtime it is the table's names
else:
    OptimizerName = Literal[OPTIMIZER_NAMES]


def planner_order() -> list[str]:
    """Optimizer names in the order the planner prefers them (least work per step first)."""
    return sorted(OPTIMIZER_TABLE, key=lambda name: OPTIMIZER_TABLE[name].plan_rank)


class OptimizerSpec(StrictModel):
    """trainjobs builds the optimizer itself in both backends, so its memory is known exactly."""

    name: OptimizerName = "adamw"
    adam_beta1: float = Field(default=0.9, ge=0, lt=1)
    adam_beta2: float = Field(default=0.999, ge=0, lt=1)
    adam_epsilon: float = Field(default=1e-8, gt=0, le=1)
    amsgrad: bool = False
    adafactor_beta1: float | None = Field(
        default=None, ge=0, lt=1, description="Adafactor keeps a first moment only when this is set."
    )
    adafactor_decay_rate: float = Field(default=-0.8, ge=-10, lt=0)
    adafactor_clip_threshold: float = Field(default=1.0, gt=0, le=1e6)
    adafactor_scale_parameter: bool = False
    adafactor_relative_step: bool = False

    @model_validator(mode="after")
    def _fields_match_optimizer(self) -> OptimizerSpec:
        # A field of another optimizer is an error only when it differs from its default, so a
        # dumped spec (which lists every field) validates again unchanged.
        fields = type(self).model_fields
        changed = {n for n in fields if n != "name" and getattr(self, n) != fields[n].default}
        wrong = sorted(changed - OPTIMIZER_TABLE[self.name].fields)
        if wrong:
            owners = ", ".join(e.name for e in OPTIMIZER_TABLE.values() if wrong[0] in e.fields)
            raise combination_error(
                f"optimizer.{wrong[0]}", f"does not apply to optimizer '{self.name}' (only to: {owners})"
            )
        return self


def optimizer_state_key(spec: OptimizerSpec) -> tuple[Hashable, ...]:
    """What the state rule of ``spec``'s optimizer reads: a memo key for its result."""
    entry = OPTIMIZER_TABLE[spec.name]
    return ("optimizer", entry.name, *(getattr(spec, f) for f in entry.state_fields))


def optimizer_state(tensors: Sequence[TensorInfo], spec: OptimizerSpec) -> OptimizerMemory:
    """State bytes and step temporary of the optimizer ``spec`` names over ``tensors``."""
    return OPTIMIZER_TABLE[spec.name].state(tensors, spec)


def build_optimizer(
    model: nn.Module, spec: OptimizerSpec, learning_rate: float, weight_decay: float
) -> torch.optim.Optimizer:
    """Build the optimizer ``spec`` names over ``model``'s trainable parameters."""
    from trainer_core.torch_optim import parameter_groups

    return OPTIMIZER_TABLE[spec.name].build(parameter_groups(model, weight_decay), spec, learning_rate, model)
