"""Parameters of a full fine-tune, a LoRA and a QLoRA run: what is trained, what is frozen, in bytes.

* Full fine-tune: every parameter trainable, fp32 master weights (``trainer_core.modeling.MASTER_DTYPE``).
* LoRA (🤗 PEFT 0.21 ``LoraModel``): per targeted Linear ``lora_A`` (r x in) and ``lora_B`` (out x r),
  no bias, fp32 (PEFT's ``autocast_adapter_dtype`` upcasts 16-bit adapters). The frozen base is kept
  in the autocast dtype under bf16/fp16 mixed precision (a frozen weight needs no fp32 master), else
  fp32. On a classification task the head is trained as PEFT's ``modules_to_save`` does: a trainable
  fp32 copy next to the frozen original.
* QLoRA: LoRA over a base whose quantised Linear weights (see :mod:`trainer_core.memory.linears`)
  are bitsandbytes 0.50 ``Params4bit`` NF4, read from a real layer: packed uint8 ``ceil(n/2)`` B, per
  64-element block an absmax (fp32; with double quant uint8, plus per 256 blocks an fp32 nested
  absmax, a 256-entry fp32 nested code and a 0-dim fp32 offset), and a 16-entry fp32 code per layer.
  Embeddings, norms, biases and the unquantised modules stay at the frozen base dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from trainer_core.memory.linears import CLASSIFIER_HEADS, LinearInfo
from trainer_core.memory.parameters import ModelStructure
from trainer_core.optimizers import TensorInfo
from trainer_core.spec import FieldError, JobSpec, SpecError
from trainer_core.spec_adapter import AdapterSpec

FP32 = 4
NF4_BLOCK = 64  # bnb's default blocksize for 4-bit weights
NESTED_BLOCK = 256  # double quant: one fp32 absmax per 256 first-level blocks
NF4_CODE_BYTES = 16 * FP32  # the NF4 code book, one per quantised layer
NESTED_CODE_BYTES = 256 * FP32 + FP32  # the nested 8-bit dynamic code and the 0-dim offset


@dataclass(frozen=True)
class ParameterLayout:
    """Trainable tensors (fp32), frozen bytes and the element count of the model a run builds."""

    trainable: tuple[TensorInfo, ...]
    frozen_bytes: int
    parameters: int
    formula: str

    # Cached: a layout is memoized per model structure, and every estimate reads these sums of a few
    # hundred tensors (a tenth of a warm estimate's time when summed each time).
    @cached_property
    def trainable_numel(self) -> int:
        return sum(t.numel for t in self.trainable)

    @cached_property
    def trainable_bytes(self) -> int:
        return sum(t.numel * t.itemsize for t in self.trainable)


def nf4_bytes(numel: int, double_quant: bool) -> int:
    """Bytes bitsandbytes keeps for one 4-bit weight of ``numel`` elements (packed + quant state)."""
    blocks = math.ceil(numel / NF4_BLOCK)
    packed = (numel + 1) // 2
    if not double_quant:
        return packed + blocks * FP32 + NF4_CODE_BYTES
    return packed + blocks + math.ceil(blocks / NESTED_BLOCK) * FP32 + NF4_CODE_BYTES + NESTED_CODE_BYTES


def frozen_base_itemsize(spec: JobSpec) -> int:
    """Element size of a frozen base under an adapter: the autocast dtype, else fp32 (see the docstring)."""
    return FP32 if spec.efficiency.mixed_precision == "no" else 2


def target_linears(structure: ModelStructure, adapter: AdapterSpec) -> list[LinearInfo]:
    """The Linear modules LoRA wraps; PEFT matches a listed name as the module name or its last parts."""
    if adapter.target_modules == "all-linear":
        return [x for x in structure.linears if x.all_linear]
    names = adapter.target_modules
    found = [x for x in structure.linears if any(x.name == n or x.name.endswith("." + n) for n in names)]
    if not found:
        suffixes = sorted({x.name.rsplit(".", 1)[-1] for x in structure.linears if x.all_linear})
        message = f"match no Linear module of this {structure.model_type} model; its Linear modules end in {suffixes}"
        raise SpecError([FieldError("adapter.target_modules", message, "invalid_combination")])
    return found


def _head_tensors(structure: ModelStructure) -> list[TensorInfo]:
    """The classifier head PEFT trains as modules_to_save (a copy of it, fp32)."""
    if structure.task == "causal-lm":
        return []
    prefixes = tuple(f"{h}." for h in CLASSIFIER_HEADS)
    return [t for t in structure.tensors if t.name.startswith(prefixes)]


def _adapter_layout(structure: ModelStructure, adapter: AdapterSpec, base_itemsize: int) -> ParameterLayout:
    targets = target_linears(structure, adapter)
    lora = tuple(
        TensorInfo(f"{x.name}.lora_{part}.weight", shape, math.prod(shape), FP32, True, False, True)
        for x in targets
        for part, shape in (("A", (adapter.r, x.in_features)), ("B", (x.out_features, adapter.r)))
    )
    head = tuple(_head_tensors(structure))
    quantized = {x.weight for x in structure.linears if x.quantized} if adapter.type == "qlora" else set()
    frozen = 0
    for t in structure.tensors:
        frozen += nf4_bytes(t.numel, adapter.double_quant) if t.name in quantized else t.numel * base_itemsize
    trainable = lora + head
    base = "4-bit NF4 Linear weights + " if quantized else ""
    formula = (
        f"frozen base ({base}others x {base_itemsize} B) + fp32 adapters r x (in + out) "
        f"over {len(targets)} Linear modules" + (" + fp32 copy of the classifier head" if head else "")
    )
    return ParameterLayout(trainable, frozen, structure.parameters + sum(t.numel for t in trainable), formula)


def parameter_layout(structure: ModelStructure, spec: JobSpec) -> ParameterLayout:
    """What ``spec`` trains and freezes of ``structure``, memoized per (adapter, base dtype)."""
    adapter = spec.adapter
    if adapter is None:
        return structure.memoized(
            ("layout", None),
            lambda: ParameterLayout(
                structure.tensors,
                (structure.parameters - structure.trainable_parameters) * FP32,
                structure.parameters,
                "sum of numel x 4 B (fp32 master)",
            ),
        )
    itemsize = frozen_base_itemsize(spec)
    key = ("layout", adapter.model_dump_json(), itemsize)
    return structure.memoized(key, lambda: _adapter_layout(structure, adapter, itemsize))
