"""``estimate_memory``: per-device training memory of a job spec, part by part, with formulas.

Total per device = parameters + gradients + optimizer state + overhead + DDP buckets
+ max(forward/backward: activations + autocast weight copies, optimizer step: its largest temporary).
The two phases do not overlap: activations are freed by the time the optimizer steps.
"""

from __future__ import annotations

from pydantic import BaseModel

from trainer_core.memory.activations import estimate_activations, logits_fp32_bytes
from trainer_core.memory.adapters import ParameterLayout, parameter_layout
from trainer_core.memory.optimizer_state import optimizer_memory
from trainer_core.memory.parameters import ModelStructure, model_structure
from trainer_core.memory_overhead import MIB, OVERHEAD_ENV, overhead_bytes_from_env
from trainer_core.optimizers import optimizer_state_key
from trainer_core.spec import FieldError, JobSpec, SpecError

GIB = 1024**3
FP32 = 4
TOTAL_FORMULA = (
    "parameters + gradients + optimizer_state + overhead + ddp_buckets"
    " + max(activations + autocast_copies + logits_fp32, optimizer_step_temporary)"
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
    logits = logits_fp32_bytes(structure, spec)
    casts = autocast_copy_bytes(structure, spec, layout)
    # DDP's buckets (25 MB each by default) together hold one copy of every gradient (accelerate does
    # not set gradient_as_bucket_view), so their sum is the gradient size whatever the bucket cap.
    ddp = grad_bytes if n_devices > 1 else 0
    transient = max(casts + logits, opt.step_temporary_bytes)
    peak_phase = max(act.bytes + casts + logits, opt.step_temporary_bytes)
    total = param_bytes + frozen_bytes + grad_bytes + opt.state_bytes + peak_phase + overhead + ddp

    parts = [
        MemoryPart(
            name="parameters",
            bytes=param_bytes + frozen_bytes,
            formula=layout.formula,
            note=spec.adapter and spec.adapter.type,
        ),
        MemoryPart(name="gradients", bytes=grad_bytes, formula="trainable numel x 4 B"),
        MemoryPart(name="optimizer_state", bytes=opt.state_bytes, formula=opt.state_formula, note=spec.optimizer.name),
        MemoryPart(name="activations", bytes=act.bytes, formula=act.formula, note="one micro-batch"),
        MemoryPart(
            name="autocast_copies",
            bytes=casts,
            formula="2 B x numel of Linear/Conv parameters (16-bit autocast copies)",
            note="forward/backward phase",
        ),
        MemoryPart(
            name="logits_fp32",
            bytes=logits,
            formula="b x s x vocab x 4 B (causal-lm: the loss upcasts the logits to fp32)",
            note="forward/backward phase",
        ),
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
        devices=n_devices,
        parts=parts,
        gpu_memory_bytes=budget,
        fits=None if budget is None else total <= budget,
    )


def human_bytes(n: int) -> str:
    """``n`` bytes in binary units, e.g. ``1.50 GiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
