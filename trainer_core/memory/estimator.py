"""``estimate_memory``: per-device training memory of a job spec, part by part, with formulas.

Total per device = parameters + reference weights + gradients + optimizer state + overhead + DDP buckets
+ max(forward/backward: activations + autocast weight copies + fp32 logits (under the chunked loss
its saved gradients and one chunk's transient instead: :mod:`trainer_core.memory.loss`), DPO's
no-grad reference forward, optimizer step: its largest temporary). The phases do not overlap: the
reference forward ends before the policy's begins, activations are freed by the time the optimizer
steps. DPO/ORPO forward ``2B`` rows (chosen + rejected); DPO's reference model is
:mod:`trainer_core.memory.reference`.
"""

from __future__ import annotations

from pydantic import BaseModel

from trainer_core.memory.activations import estimate_activations, logits_fp32_bytes
from trainer_core.memory.adapters import ParameterLayout, parameter_layout
from trainer_core.memory.loss import CHUNK_FORMULA, GRADIENTS_FORMULA, chunked_loss_chunk, chunked_loss_gradients
from trainer_core.memory.optimizer_state import optimizer_memory
from trainer_core.memory.parameters import ModelStructure, model_structure
from trainer_core.memory.reference import ReferencePart, reference_forward, reference_weights
from trainer_core.memory_overhead import MIB, OVERHEAD_ENV, overhead_bytes_from_env
from trainer_core.optimizers import optimizer_state_key
from trainer_core.spec import FieldError, JobSpec, SpecError

GIB = 1024**3
FORWARD_PHASE = "forward/backward phase"
LOGITS_SFT = "b x s x vocab x 4 B (causal-lm: the loss upcasts the logits to fp32)"
LOGITS_PREFERENCE = (
    "2B x s x vocab x 4 B: each row's fp32 log-softmax TRL's selective_log_softmax saves from 16-bit logits"
    " (0 from fp32 logits)"
)
FP32 = 4
TOTAL_FORMULA = (
    "parameters + reference_weights + gradients + optimizer_state + overhead + ddp_buckets"
    " + max(activations + autocast_copies + logits_fp32 (chunked loss: chunked_loss_gradients + chunked_loss_chunk),"
    " reference_forward, optimizer_step_temporary)"
)


class MemoryPart(BaseModel):
    """One line of the breakdown."""

    name: str
    bytes: int
    formula: str
    note: str | None = None


class MemoryEstimate(BaseModel):
    """Per-device memory of a training job; JSON-serialisable with ``model_dump(mode="json")``."""

    model: str
    parameters: int
    trainable_parameters: int
    parameter_bytes: int
    gradient_bytes: int
    optimizer_state_bytes: int
    optimizer_state_mb: int
    activation_bytes: int
    transient_bytes: int
    overhead_bytes: int
    ddp_bucket_bytes: int
    total_bytes: int
    # DPO's reference model (0 for SFT, ORPO, adapters scoring the base, `reference: precomputed`).
    reference_weight_bytes: int = 0
    reference_forward_bytes: int = 0
    devices: int
    parts: list[MemoryPart]
    gpu_memory_bytes: int | None = None
    fits: bool | None = None


def autocast_copy_bytes(structure: ModelStructure, spec: JobSpec, layout: ParameterLayout) -> int:
    """16-bit copies autocast makes of fp32 Linear/Conv weights; cached for the forward, saved for backward.

    Under an adapter the frozen base is 16-bit already (or 4-bit): only the fp32 trainable tensors are copied.
    """
    if spec.efficiency.mixed_precision == "no":
        return 0
    if spec.adapter is None:
        return 2 * structure.autocast_numel
    return 2 * sum(t.numel for t in layout.trainable if t.autocast)


def estimate_memory(
    spec: JobSpec,
    *,
    devices: int | None = None,
    gpu_memory_gb: float | None = None,
    overhead_bytes: int | None = None,
    num_labels: int | None = None,
) -> MemoryEstimate:
    """Estimate per-device training memory of ``spec``.

    ``devices`` defaults to ``spec.resources.num_processes``, the budget ``gpu_memory_gb`` (GiB) to
    ``spec.resources.gpu_memory_gb``, ``num_labels`` to the config's own (else 2): the estimator
    never reads the dataset. Raises :class:`~trainer_core.memory.UnknownModelError` for a model it
    cannot resolve, :class:`~trainer_core.spec.SpecError` for settings the model cannot run.
    """
    structure = model_structure(spec.model, spec.task, num_labels)
    if spec.efficiency.gradient_checkpointing and not structure.supports_gradient_checkpointing:
        raise SpecError(
            [
                FieldError(
                    "efficiency.gradient_checkpointing",
                    f"{structure.model_type} models do not support gradient checkpointing",
                )
            ]
        )
    n_devices = devices if devices is not None else spec.resources.num_processes
    budget_gb = gpu_memory_gb if gpu_memory_gb is not None else spec.resources.gpu_memory_gb
    overhead = overhead_bytes if overhead_bytes is not None else overhead_bytes_from_env()

    layout = parameter_layout(structure, spec)
    param_bytes = layout.trainable_bytes
    frozen_bytes = layout.frozen_bytes
    grad_bytes = param_bytes  # gradients: trainable parameters only, at their (fp32) dtype
    optimizer = spec.optimizer
    # The table names the fields each state rule reads: they, the layout and the structure are the memo key.
    opt_key = (optimizer_state_key(optimizer), id(layout))  # layouts are memoized on the structure too
    opt = structure.memoized(opt_key, lambda: optimizer_memory(layout.trainable, optimizer))
    act = estimate_activations(structure, spec, layout)
    # the loss's share of the forward phase: the fp32 logits, or what the chunked loss holds instead
    loss_parts = _loss_parts(structure, spec)
    loss = sum(part.bytes for part in loss_parts)
    casts = autocast_copy_bytes(structure, spec, layout)
    # DDP's buckets (25 MB each by default) together hold one copy of every gradient (accelerate does
    # not set gradient_as_bucket_view), so their sum is the gradient size whatever the bucket cap.
    ddp = grad_bytes if n_devices > 1 else 0
    ref_weights, ref_forward = reference_weights(spec, layout), reference_forward(structure, spec)
    transient = max(casts + loss, ref_forward.bytes, opt.step_temporary_bytes)
    peak_phase = max(act.bytes + casts + loss, ref_forward.bytes, opt.step_temporary_bytes)
    fixed = param_bytes + frozen_bytes + ref_weights.bytes + grad_bytes + opt.state_bytes
    total = fixed + peak_phase + overhead + ddp
    weights_line, forward_line = _reference_parts(spec, ref_weights, ref_forward)

    parts = [
        MemoryPart(
            name="parameters",
            bytes=param_bytes + frozen_bytes,
            formula=layout.formula,
            note=spec.adapter and spec.adapter.type,
        ),
        *weights_line,
        MemoryPart(name="gradients", bytes=grad_bytes, formula="trainable numel x 4 B"),
        MemoryPart(name="optimizer_state", bytes=opt.state_bytes, formula=opt.state_formula, note=spec.optimizer.name),
        MemoryPart(name="activations", bytes=act.bytes, formula=act.formula, note="one micro-batch"),
        MemoryPart(
            name="autocast_copies",
            bytes=casts,
            formula="2 B x numel of Linear/Conv parameters (16-bit autocast copies)",
            note=FORWARD_PHASE,
        ),
        *loss_parts,
        *forward_line,
        MemoryPart(
            name="optimizer_step_temporary",
            bytes=opt.step_temporary_bytes,
            formula=opt.step_temporary_formula,
            note="optimizer-step phase; the total counts the larger phase",
        ),
        MemoryPart(
            name="overhead", bytes=overhead, formula=f"constant ({OVERHEAD_ENV} MiB, default 1 GiB, or overhead_bytes)"
        ),
        MemoryPart(
            name="ddp_buckets",
            bytes=ddp,
            formula="one bucketed copy of the gradients when devices > 1 (25 MiB buckets)",
        ),
    ]
    budget = int(budget_gb * GIB) if budget_gb is not None else None
    return MemoryEstimate(
        model=structure.source,
        parameters=layout.parameters,
        trainable_parameters=layout.trainable_numel,
        parameter_bytes=param_bytes + frozen_bytes,
        gradient_bytes=grad_bytes,
        optimizer_state_bytes=opt.state_bytes,
        optimizer_state_mb=round(opt.state_bytes / MIB),
        activation_bytes=act.bytes,
        transient_bytes=transient,
        overhead_bytes=overhead,
        ddp_bucket_bytes=ddp,
        total_bytes=total,
        reference_weight_bytes=ref_weights.bytes,
        reference_forward_bytes=ref_forward.bytes,
        devices=n_devices,
        parts=parts,
        gpu_memory_bytes=budget,
        fits=None if budget is None else total <= budget,
    )


def _loss_parts(structure: ModelStructure, spec: JobSpec) -> list[MemoryPart]:
    """The fp32 logits' line; under the chunked loss (or Liger's) its two lines instead."""
    held = chunked_loss_gradients(structure, spec)
    if not held:
        formula = LOGITS_PREFERENCE if spec.is_preference else LOGITS_SFT
        return [
            MemoryPart(
                name="logits_fp32", bytes=logits_fp32_bytes(structure, spec), formula=formula, note=FORWARD_PHASE
            )
        ]
    how = "liger's fused linear cross-entropy, counted as the chunked loss" if spec.efficiency.liger else None
    return [
        MemoryPart(name="chunked_loss_gradients", bytes=held, formula=GRADIENTS_FORMULA, note=how or FORWARD_PHASE),
        MemoryPart(
            name="chunked_loss_chunk",
            bytes=chunked_loss_chunk(structure, spec),
            formula=CHUNK_FORMULA,
            note=f"{FORWARD_PHASE}, during the loss's forward",
        ),
    ]


def _reference_parts(
    spec: JobSpec, weights: ReferencePart, forward: ReferencePart
) -> tuple[list[MemoryPart], list[MemoryPart]]:
    """DPO/ORPO's reference lines, weights and forward (SFT estimates list neither)."""
    if not spec.is_preference:
        return [], []
    note = f"dpo, reference: {spec.preference_settings.reference}" if spec.method == "dpo" else spec.method
    phase = "reference-forward phase, before the policy's; the total counts the largest phase"
    return (
        [MemoryPart(name="reference_weights", bytes=weights.bytes, formula=weights.formula, note=note)],
        [MemoryPart(name="reference_forward", bytes=forward.bytes, formula=forward.formula, note=phase)],
    )


def human_bytes(n: int) -> str:
    """``n`` bytes in binary units, e.g. ``1.50 GiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
