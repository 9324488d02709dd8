"""What DPO's reference model costs in memory: its weights, and the transient of its no-grad forward.

How a run scores the reference (trainer_core/backends/reference.py):

* LoRA / QLoRA: the trained model itself with the adapter disabled: no extra weights. A job whose
  ``init_from`` continues an adapter keeps the starting adapter as a second, frozen PEFT adapter
  (disabling the trained one would score the bare base): its fp32 LoRA tensors, once more.
* Full fine-tune with ``reference: base``: a frozen copy of the starting weights at the dtype training
  holds them in (the fp32 master, ``trainer_core.modeling.MASTER_DTYPE``), no gradients, no optimizer
  state. Its buffers (rotary ``inv_freq``) are left out, as the trained model's are from
  ``parameter_bytes``.
* ``reference: precomputed``: the log-probs are scored once before training (below), and the run
  keeps two floats a pair. ORPO has no reference. Both: nothing here.

The starting adapter of an ``init_from`` job is an adapter of the run's own PEFT model, so the memory
event's ``parameter_bytes`` includes it; the estimate keeps it in ``reference_weight_bytes`` apart.

The reference forward runs under ``torch.no_grad`` over the same ``2B`` rows *before* the policy's
forward (trainer_core/backends/objective.py, ``Objective.__call__``), so it is a phase of its own:
no activation is saved yet, the autocast cache is empty (the frozen copy's weights do not require
grad and are cast one Linear at a time, not cached; an adapter-disabled base is 16-bit already).
At its peak it holds the fp32 residual stream, and the larger of one layer's working set (bounded by
what the same layer saves for backward in training) and the head's ``2B x s x vocab`` logits at the
autocast width with, from 16-bit logits, one row's fp32 log-softmax (TRL's ``selective_log_softmax``
loops over rows; without gradients each is freed before the next); the per-row sums it returns are a
few bytes. This phase
is almost always below the training forward's (which holds every layer and the same logits), but it
is counted as one more ``max`` term rather than argued away. The ``precomputed`` pass scores
``per_device_eval_batch_size`` pairs at a time before training, when neither gradients nor optimizer
state exist yet: it is dominated by the training step and not counted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trainer_core.memory.activations import (
    LOGIT_BYTES,
    NORM_BYTES,
    encoder_shapes,
    forward_rows,
    layer_bytes,
    text_sequence,
)
from trainer_core.memory.adapters import ParameterLayout
from trainer_core.memory.parameters import ModelStructure
from trainer_core.spec import JobSpec


@dataclass(frozen=True)
class ReferencePart:
    bytes: int
    formula: str


def scores_reference(spec: JobSpec) -> bool:
    """Whether each training step runs a reference forward: DPO with ``reference: base``."""
    return spec.method == "dpo" and spec.preference_settings.reference == "base"


def reference_weights(spec: JobSpec, layout: ParameterLayout) -> ReferencePart:
    """The reference model's own weights on the device (see the module docstring)."""
    if not scores_reference(spec):
        why = "ORPO: no reference model" if spec.method == "orpo" else "reference scored before training"
        return ReferencePart(0, f"0 ({why})" if spec.is_preference else "0")
    if spec.adapter is None:
        copy = layout.trainable_bytes + layout.frozen_bytes
        return ReferencePart(copy, "frozen copy of the starting weights, numel x 4 B (fp32 master)")
    if spec.init_from is not None:
        lora = sum(t.numel * t.itemsize for t in layout.trainable if ".lora_" in t.name)
        return ReferencePart(lora, "frozen copy of the starting adapter (init_from), fp32 r x (in + out)")
    return ReferencePart(0, "0 (the base with the adapter disabled)")


def reference_forward(structure: ModelStructure, spec: JobSpec) -> ReferencePart:
    """The no-grad reference forward's peak over ``2B`` rows: a phase before the policy's forward."""
    if not scores_reference(spec) or structure.task != "causal-lm":
        return ReferencePart(0, "0 (no reference forward during training)")
    rows, s = forward_rows(spec), text_sequence(structure, spec)
    w = 4 if spec.efficiency.mixed_precision == "no" else 2
    shapes = [dataclasses.replace(x, dropout=False) for x in encoder_shapes(structure, s)]  # eval mode
    layer = max((layer_bytes(x, rows, w, NORM_BYTES) for x in shapes), default=0)
    # The logits, and (16-bit logits) one row's fp32 log-softmax at a time: TRL's selective_log_softmax loop.
    head = rows * s * structure.num_labels * w + (s * structure.num_labels * LOGIT_BYTES if w == 2 else 0)
    residual = rows * s * shapes[0].h * NORM_BYTES if shapes else 0
    row = " + one row's fp32 log-softmax s x vocab x 4 B" if w == 2 else ""
    formula = (
        f"no grad, 2B={rows} rows, s={s}: fp32 residual 2B x s x h x 4 B + max(one layer's working set, "
        f"logits 2B x s x vocab x {w} B{row})"
    )
    return ReferencePart(residual + max(layer, head), formula)
