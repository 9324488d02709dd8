"""``estimate_memory``: per-device training memory of a job spec, part by part, with formulas.

Total per device = parameters + reference weights + gradients + optimizer state + overhead + DDP buckets
+ max(forward/backward: activations + autocast weight copies + fp32 logits (under the chunked loss
its saved gradients and one chunk's transient instead: :mod:`trainer_core.memory.loss`), DPO's
no-grad reference forward, optimizer step: its largest temporary). The phases do not overlap: the
reference forward ends before the policy's begins, activations are freed by the time the optimizer
steps. DPO/ORPO forward ``2B`` rows (chosen + rejected); DPO's reference model is
:mod:`trainer_core.memory.reference`.

Under ``efficiency.sharding: fsdp`` each rank holds its shards (:mod:`trainer_core.memory.sharding`):
parameters, gradients and optimizer state are rank ``rank``'s (default 0, the largest), there are no
DDP buckets nor autocast copies, and the forward phase adds the weights gathered whole. With
``fsdp.cpu_offload`` the shards live in host memory: counted in ``host_bytes``, not in the device total.
"""

from __future__ import annotations

from pydantic import BaseModel

from trainer_core.memory.activations import estimate_activations, logits_fp32_bytes
from trainer_core.memory.adapters import ParameterLayout, parameter_layout
from trainer_core.memory.loss import CHUNK_FORMULA, GRADIENTS_FORMULA, chunked_loss_chunk, chunked_loss_gradients
from trainer_core.memory.optimizer_state import optimizer_memory
from trainer_core.memory.parameters import ModelStructure, model_structure
from trainer_core.memory.reference import ReferencePart, reference_forward, reference_weights
from trainer_core.memory.sharding import GRADIENTS_FORMULA as SHARDED_GRADIENTS
from trainer_core.memory.sharding import PARAMETERS_FORMULA as SHARDED_PARAMETERS
from trainer_core.memory.sharding import ShardedLayout, sharded_layout
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
    # FSDP: the weights gathered whole during forward/backward; the bytes cpu_offload keeps in host memory.
    sharding: str = "none"
    gather_bytes: int = 0
    host_bytes: int = 0
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
    rank: int = 0,
) -> MemoryEstimate:
    """Estimate per-device training memory of ``spec``.

    ``devices`` defaults to the world size (``spec.world_size``), the budget ``gpu_memory_gb`` (GiB) to
    ``spec.resources.gpu_memory_gb``, ``num_labels`` to the config's own (else 2): the estimator
    never reads the dataset. ``rank``: whose shards a sharded run counts (rank 0 holds the most).
    Raises :class:`~trainer_core.memory.UnknownModelError` for a model it cannot resolve,
    :class:`~trainer_core.spec.SpecError` for settings the model cannot run.
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
    n_devices = devices if devices is not None else spec.world_size
    budget_gb = gpu_memory_gb if gpu_memory_gb is not None else spec.resources.gpu_memory_gb
    overhead = overhead_bytes if overhead_bytes is not None else overhead_bytes_from_env()

    layout = parameter_layout(structure, spec)
    param_bytes = layout.trainable_bytes
    frozen_bytes = layout.frozen_bytes
    grad_bytes = param_bytes  # gradients: trainable parameters only, at their (fp32) dtype
    optimizer = spec.optimizer
    shards = sharded_layout(structure, spec, n_devices, rank) if spec.fsdp_settings is not None else None
    if shards is None:
        # The table names the fields each state rule reads: they, the layout and the structure are the memo key.
        opt_key = (optimizer_state_key(optimizer), id(layout))  # layouts are memoized on the structure too
        opt = structure.memoized(opt_key, lambda: optimizer_memory(layout.trainable, optimizer))
    else:
        param_bytes, frozen_bytes, grad_bytes = shards.parameter_bytes, 0, shards.gradient_bytes
        opt = optimizer_memory(shards.local, optimizer)
    act = estimate_activations(structure, spec, layout)
    # the loss's share of the forward phase: the fp32 logits, or what the chunked loss holds instead
    loss_parts = _loss_parts(structure, spec)
    loss = sum(part.bytes for part in loss_parts)
    # Sharded: FSDP's mixed precision gathers 16-bit weights instead of autocast copying them.
    casts = autocast_copy_bytes(structure, spec, layout) if shards is None else 0
    gather = shards.gather_bytes if shards is not None else 0
    # DDP's buckets (25 MB each by default) together hold one copy of every gradient (accelerate does
    # not set gradient_as_bucket_view), so their sum is the gradient size whatever the bucket cap.
    ddp = grad_bytes if n_devices > 1 and shards is None else 0
    ref_weights, ref_forward = reference_weights(spec, layout), reference_forward(structure, spec)
    offloaded = shards is not None and shards.offloaded
    step = 0 if offloaded else opt.step_temporary_bytes  # an offloaded optimizer steps on the CPU
    transient = max(casts + gather + loss, ref_forward.bytes, step)
    peak_phase = max(act.bytes + casts + gather + loss, ref_forward.bytes, step)
    fixed = param_bytes + frozen_bytes + ref_weights.bytes + grad_bytes + opt.state_bytes
    host = param_bytes + grad_bytes + opt.state_bytes if offloaded else 0
    total = fixed - host + peak_phase + overhead + ddp
    weights_line, forward_line = _reference_parts(spec, ref_weights, ref_forward)

    held = "in host memory (fsdp.cpu_offload), not in the total" if offloaded else None
    parts = [
        MemoryPart(
            name="parameters",
            bytes=param_bytes + frozen_bytes,
            formula=layout.formula if shards is None else SHARDED_PARAMETERS,
            note=held or (spec.adapter and spec.adapter.type) or _rank_note(shards, rank, n_devices),
        ),
        *weights_line,
        MemoryPart(
            name="gradients",
            bytes=grad_bytes,
            formula="trainable numel x 4 B" if shards is None else SHARDED_GRADIENTS,
            note=held,
        ),
        MemoryPart(
            name="optimizer_state",
            bytes=opt.state_bytes,
            formula=opt.state_formula,
            note=f"{spec.optimizer.name}, {held}" if held else spec.optimizer.name,
        ),
        MemoryPart(name="activations", bytes=act.bytes, formula=act.formula, note="one micro-batch"),
        MemoryPart(
            name="autocast_copies",
            bytes=casts,
            formula="2 B x numel of Linear/Conv parameters (16-bit autocast copies)",
            note=FORWARD_PHASE,
        ),
        *loss_parts,
        *_gather_part(shards),
        *forward_line,
        MemoryPart(
            name="optimizer_step_temporary",
            bytes=step,
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
        sharding=spec.efficiency.sharding,
        gather_bytes=gather,
        host_bytes=host,
        devices=n_devices,
        parts=parts,
        gpu_memory_bytes=budget,
        fits=None if budget is None else total <= budget,
    )


def _rank_note(shards: ShardedLayout | None, rank: int, devices: int) -> str | None:
    return None if shards is None else f"rank {rank}'s shards of {devices}"


def _gather_part(shards: ShardedLayout | None) -> list[MemoryPart]:
    """A sharded run's forward/backward line: the weights it gathers whole (none unsharded)."""
    if shards is None:
        return []
    return [MemoryPart(name="fsdp_gathered", bytes=shards.gather_bytes, formula=shards.gather_formula,
                       note=FORWARD_PHASE)]


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
