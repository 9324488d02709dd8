"""``plan_memory``: which settings make a job fit a device budget, fastest first.

It varies the optimizer (every entry of ``trainer_core.optimizers.OPTIMIZER_TABLE``), the micro-batch
(halved while even, with gradient accumulation doubled so the effective batch is unchanged), gradient
checkpointing (only where the model supports it), the chunked loss (an SFT causal LM whose logits are
its head's output, without Liger: no logits held, at no recomputation) and mixed precision, and
estimates every combination. For each (optimizer, precision) pair it keeps the fastest combination
that fits, then orders entries by expected speed: no recomputation first, then larger micro-batches,
then the fewest changes to the spec, then 16-bit autocast before fp32 (tensor cores), then the table's
``plan_rank`` (adamw, adamw_8bit, adafactor: extra work per step).

When no setting of the spec's own kind fits (a full fine-tune, or the spec's adapter), or a DPO/ORPO
spec does not fit as written, it adds, for an SFT full fine-tune on several processes, the same
settings sharded (``efficiency.sharding: fsdp`` on the accelerate backend): ``shard_grad_op``, then
``full_shard``, then ``full_shard`` with CPU offload, one entry each (the fastest fitting setting);
for a DPO job scoring a reference every step (``preference.reference: base``), the same settings with
the reference log-probs precomputed before training (no frozen copy, no reference forward a step; one
entry per (optimizer, precision)); then
adapter options: LoRA, then QLoRA (a 4-bit base), each at rank 8, 16 and 64 (``alpha = 2r``,
all-linear), one entry per adapter (its fastest fitting setting). Every entry fits by the
estimator's own numbers.

``next_oom_changes`` walks the same ladder one rung at a time, without estimates: what the worker
applies before it requeues a job that ran out of device memory (worker/oom_retry.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable
from typing import Any

from pydantic import BaseModel

from trainer_core.chunked_loss import changes_logits
from trainer_core.memory.estimator import GIB, estimate_memory, human_bytes
from trainer_core.memory.parameters import ModelStructure, model_structure
from trainer_core.memory.reference import scores_reference
from trainer_core.optimizers import OPTIMIZER_TABLE, planner_order
from trainer_core.spec import JobSpec, OptimizerSpec, SpecError, parse_spec
from trainer_core.spec_sharding import SHARDED_OPTIMIZERS

ADAPTER_RANKS = (8, 16, 64)
# Sharded forms of a full fine-tune, fastest first: one gather a step less, then least memory, then offload
# (the first two on the device alone: the ones offered over more nodes).
SHARDING_TIERS: tuple[dict[str, Any], ...] = tuple(
    {"efficiency.sharding": "fsdp", "training.backend": "accelerate", "efficiency.fsdp": fsdp}
    for fsdp in (
        {"strategy": "shard_grad_op"}, {"strategy": "full_shard"}, {"strategy": "full_shard", "cpu_offload": True},
    )
)  # fmt: skip
PRECOMPUTED_REFERENCE: dict[str, Any] = {"preference.reference": "precomputed"}


class PlanEntry(BaseModel):
    """A configuration that fits: what changed (dotted spec paths), the new spec, why it helps."""

    changes: dict[str, Any]
    spec: JobSpec
    estimate_total_bytes: int
    reason: str


class Plan(BaseModel):
    """Configurations that fit ``budget_bytes``, best first; and the smallest footprint possible."""

    budget_bytes: int
    entries: list[PlanEntry]
    minimum_total_bytes: int
    minimum_changes: dict[str, Any]


def _optimizer_dict(current: OptimizerSpec, name: str) -> dict[str, Any]:
    """The optimizer section for ``name``, keeping the user's hyper-parameters that apply to both."""
    if name == current.name:
        return current.model_dump(exclude_unset=True)
    # amsgrad is dropped (apply_changes sets it False); other shared fields carry over.
    shared = (OPTIMIZER_TABLE[name].fields & OPTIMIZER_TABLE[current.name].fields) - {"amsgrad"}
    new: dict[str, Any] = {"name": name}
    new.update({f: getattr(current, f) for f in sorted(shared) if f in current.model_fields_set})
    return new


def apply_changes(spec: JobSpec, changes: dict[str, Any]) -> JobSpec:
    """A validated copy of ``spec`` with dotted-path ``changes`` applied (optimizer switches included)."""
    data = spec.model_dump(exclude_unset=True)
    for path, value in changes.items():
        section, _, field = path.partition(".")
        if path == "adapter":
            data["adapter"] = value
        elif path == "optimizer.name":
            data["optimizer"] = _optimizer_dict(spec.optimizer, value)
        elif path != "optimizer.amsgrad":  # dropped with the switch to an optimizer without it
            data[section] = {**(data.get(section) or {}), field: value}  # a section left out or null
    return parse_spec(data)


def next_oom_changes(spec: JobSpec) -> dict[str, Any] | None:
    """Spec changes (dotted paths) one rung below ``spec`` with the same effective batch; None at the bottom.

    A DPO full fine-tune that keeps a frozen reference copy first scores the reference once before
    training instead (``preference.reference: precomputed``: the same losses, one model copy less). Then
    halve the micro-batch and double accumulation, then gradient checkpointing, then a lighter
    optimizer (the planner's order of the optimizer table: lighter state further on).
    """
    if scores_reference(spec) and spec.adapter is None:
        return dict(PRECOMPUTED_REFERENCE)
    batch, accum = spec.training.per_device_train_batch_size, spec.efficiency.gradient_accumulation_steps
    if batch > 1 and batch % 2 == 0:
        return {"training.per_device_train_batch_size": batch // 2, "efficiency.gradient_accumulation_steps": accum * 2}
    if not spec.efficiency.gradient_checkpointing:
        return {"efficiency.gradient_checkpointing": True}
    order = planner_order()
    lighter = order[order.index(spec.optimizer.name) + 1 :]
    if spec.fsdp_settings is not None:  # sharding steps only the optimizers that build state per shard
        lighter = [name for name in lighter if name in SHARDED_OPTIMIZERS]
    return {"optimizer.name": lighter[0]} if lighter else None


def _adapter_dict(kind: str, r: int, precision: str) -> dict[str, Any]:
    adapter: dict[str, Any] = {"type": kind, "r": r, "alpha": 2 * r}
    if kind == "qlora" and precision != "no":
        adapter["compute_dtype"] = precision  # the spec requires it to match autocast
    return adapter


def adapter_tiers(spec: JobSpec) -> list[list[tuple[str, int]]]:
    """Adapter options beyond the spec's own kind: LoRA (when the spec has none), then QLoRA, per rank."""
    kinds = {None: ["lora", "qlora"], "lora": ["qlora"], "qlora": []}[spec.adapter.type if spec.adapter else None]
    return [[(kind, r) for r in ADAPTER_RANKS] for kind in kinds]


def offers_chunked_loss(spec: JobSpec, structure: ModelStructure) -> bool:
    """Whether the planner may turn ``efficiency.chunked_loss`` on: an SFT causal LM whose logits are its
    head's output (what preflight accepts), not already chunked nor under Liger (which refuses both)."""
    efficiency = spec.efficiency
    if spec.task != "causal-lm" or spec.is_preference or efficiency.chunked_loss or efficiency.liger:
        return False
    return changes_logits(structure.config) is None


def offers_sharding(spec: JobSpec) -> bool:
    """Whether the planner may shard: an unsharded SFT full fine-tune on several processes."""
    return (
        spec.world_size > 1 and spec.efficiency.sharding == "none" and spec.adapter is None
        and not spec.is_preference and spec.efficiency.local_sgd_steps is None
    )  # fmt: skip


def _candidates(
    spec: JobSpec,
    checkpointing_ok: bool,
    adapter: tuple[str, int] | None = None,
    fixed: dict[str, Any] | None = None,
    chunked_ok: bool = False,
) -> list[dict[str, Any]]:
    """Every combination, as changes relative to ``spec`` (an empty dict is the spec itself);
    ``adapter`` (type, rank) replaces the spec's adapter, ``fixed`` changes are part of each;
    ``chunked_ok`` varies ``efficiency.chunked_loss`` too (:func:`offers_chunked_loss`)."""
    b0 = spec.training.per_device_train_batch_size
    ga0 = spec.efficiency.gradient_accumulation_steps
    halvings = [0]
    while b0 % 2 ** (halvings[-1] + 1) == 0:
        halvings.append(halvings[-1] + 1)
    precisions = list(dict.fromkeys([spec.efficiency.mixed_precision, "bf16", "no"]))
    ckpts = [False, True] if checkpointing_ok else [False]
    chunked = [False, True] if chunked_ok else [spec.efficiency.chunked_loss]
    out = []
    for opt, k, ckpt, chunk, mp in itertools.product(planner_order(), halvings, ckpts, chunked, precisions):
        wanted: dict[str, Any] = {
            "optimizer.name": opt,
            "training.per_device_train_batch_size": b0 // 2**k,
            "efficiency.gradient_accumulation_steps": ga0 * 2**k,
            "efficiency.gradient_checkpointing": ckpt,
            "efficiency.chunked_loss": chunk,
            "efficiency.mixed_precision": mp,
        }
        current = {
            "optimizer.name": spec.optimizer.name,
            "training.per_device_train_batch_size": b0,
            "efficiency.gradient_accumulation_steps": ga0,
            "efficiency.gradient_checkpointing": spec.efficiency.gradient_checkpointing,
            "efficiency.chunked_loss": spec.efficiency.chunked_loss,
            "efficiency.mixed_precision": spec.efficiency.mixed_precision,
        }
        changes = {key: value for key, value in wanted.items() if current[key] != value} | (fixed or {})
        if adapter is not None:
            changes["adapter"] = _adapter_dict(*adapter, mp)
        if spec.optimizer.amsgrad and "amsgrad" not in OPTIMIZER_TABLE[opt].fields:
            changes["optimizer.amsgrad"] = False
        out.append(changes)
    return out


def _speed_key(spec: JobSpec, new: JobSpec, changes: dict[str, Any]) -> tuple[int, int, int, int, int]:
    halvings = (spec.training.per_device_train_batch_size // new.training.per_device_train_batch_size).bit_length()
    return (
        int(new.efficiency.gradient_checkpointing),
        halvings,
        len(changes),
        int(new.efficiency.mixed_precision == "no"),
        OPTIMIZER_TABLE[new.optimizer.name].plan_rank,
    )


def _reason(spec: JobSpec, new: JobSpec, changes: dict[str, Any], total: int, budget: int) -> str:
    phrases = []
    if "adapter" in changes and new.adapter is not None:
        base = "4-bit NF4 base" if new.adapter.type == "qlora" else "frozen base"
        phrases.append(f"{new.adapter.type.upper()} r={new.adapter.r} adapter ({base}, adapters trained)")
    if "preference.reference" in changes:
        phrases.append("reference log-probs precomputed before training (no frozen copy, no reference forward a step)")
    if "optimizer.name" in changes:
        phrases.append(f"{new.optimizer.name} optimizer instead of {spec.optimizer.name}")
    if "training.per_device_train_batch_size" in changes:
        phrases.append(
            f"micro-batch {new.training.per_device_train_batch_size} x "
            f"{new.efficiency.gradient_accumulation_steps} accumulation steps (same effective batch)"
        )
    if "efficiency.gradient_checkpointing" in changes:
        on = new.efficiency.gradient_checkpointing
        phrases.append("gradient checkpointing (recomputes the forward)" if on else "no gradient checkpointing")
    if "efficiency.chunked_loss" in changes:
        phrases.append("chunked loss (no logits held, same loss and gradients)")
    if "efficiency.sharding" in changes and new.fsdp_settings is not None:
        fsdp = new.fsdp_settings
        offload = ", shards in host memory" if fsdp.cpu_offload else ""
        phrases.append(f"FSDP {fsdp.strategy} over {new.world_size} processes{offload}")
    if "resources.num_nodes" in changes:
        per_node = new.resources.num_processes
        phrases.append(f"{new.resources.num_nodes} nodes of {per_node} process{'' if per_node == 1 else 'es'}")
    if "efficiency.mixed_precision" in changes:
        mp = new.efficiency.mixed_precision
        phrases.append("fp32, no autocast" if mp == "no" else f"{mp} autocast (16-bit activations)")
    what = "; ".join(phrases) or "fits as it is"
    return f"{what}: {human_bytes(total)} of {human_bytes(budget)}"


def more_nodes(spec: JobSpec, max_nodes: int) -> list[int]:
    """Node counts above the spec's, doubling, up to ``max_nodes`` (the machines that can take the job)."""
    counts, n = [], spec.resources.num_nodes * 2
    while n <= max_nodes:
        counts.append(n)
        n *= 2
    return counts


def plan_memory(spec: JobSpec, gpu_memory_gb: float, *, devices: int | None = None, max_nodes: int = 1) -> Plan:
    """Configurations of ``spec`` that fit ``gpu_memory_gb`` (GiB) per device, fastest first.

    ``max_nodes``: machines the job may span (e.g. the workers of its queue). A full fine-tune that does
    not fit even sharded over its own processes is offered sharded over more nodes, the fewest that fit.
    """
    budget = int(gpu_memory_gb * GIB)
    structure = model_structure(spec.model, spec.task)
    ckpt_ok, chunked_ok = structure.supports_gradient_checkpointing, offers_chunked_loss(spec, structure)
    scored = _scored(spec, _candidates(spec, ckpt_ok, chunked_ok=chunked_ok), devices)
    # The spec's own kind: one entry per (optimizer, precision), slower variants of a fitting pair are noise.
    entries = _fitting(spec, scored, budget, _optimizer_and_precision)
    # A DPO/ORPO job that does not fit as written is shown its method's cheaper forms beside those
    # settings; any other job only when none of them fits.
    widen = not entries or (spec.is_preference and estimate_memory(spec, devices=devices).total_bytes > budget)
    sharded_entries: list[PlanEntry] = []
    for fixed in SHARDING_TIERS if widen and offers_sharding(spec) else ():
        # sharding takes fewer optimizers and precisions: the candidates its rules refuse are left out
        candidates = _candidates(spec, ckpt_ok, fixed=fixed, chunked_ok=chunked_ok)
        sharded = _scored(spec, candidates, devices, skip_refused=True)
        scored += sharded
        sharded_entries += _fitting(spec, sharded, budget, lambda new: "one per sharding mode")
    on_device = [e for e in sharded_entries if e.spec.fsdp_settings and not e.spec.fsdp_settings.cpu_offload]
    spread: list[PlanEntry] = []
    # More machines before the host-memory offload, which steps the optimizer on the CPU.
    for nodes in more_nodes(spec, max_nodes) if widen and not on_device and devices is None else ():
        scaled = apply_changes(spec, {"resources.num_nodes": nodes})
        for fixed in SHARDING_TIERS[:2] if offers_sharding(scaled) else ():
            candidates = _candidates(spec, ckpt_ok, fixed={**fixed, "resources.num_nodes": nodes},
                                     chunked_ok=chunked_ok)  # fmt: skip
            wider = _scored(spec, candidates, None, skip_refused=True)
            scored += wider
            spread += _fitting(spec, wider, budget, lambda new: "one per sharding mode")
        if spread:  # the fewest nodes that fit
            break
    entries += on_device + spread + [e for e in sharded_entries if e not in on_device]
    if widen and scores_reference(spec):
        precomputed = _scored(spec, _candidates(spec, ckpt_ok, fixed=PRECOMPUTED_REFERENCE), devices)
        scored += precomputed
        entries += _fitting(spec, precomputed, budget, _optimizer_and_precision)
    for tier in adapter_tiers(spec) if widen else []:
        for option in tier:
            tier_scored = _scored(spec, _candidates(spec, ckpt_ok, option, chunked_ok=chunked_ok), devices)
            scored += tier_scored
            entries += _fitting(spec, tier_scored, budget, lambda new: "one per adapter")
    smallest = min(scored, key=lambda item: (item[3], item[0]))
    return Plan(budget_bytes=budget, entries=entries, minimum_total_bytes=smallest[3], minimum_changes=smallest[1])


Scored = tuple[tuple[int, ...], dict[str, Any], JobSpec, int]


def _optimizer_and_precision(new: JobSpec) -> Hashable:
    return (new.optimizer.name, new.efficiency.mixed_precision)


def _scored(
    spec: JobSpec, candidates: list[dict[str, Any]], devices: int | None, *, skip_refused: bool = False
) -> list[Scored]:
    """Each candidate with its speed key, validated spec and estimated total, fastest first;
    ``skip_refused``: leave out a candidate the spec's rules refuse (else its SpecError propagates)."""
    out: list[Scored] = []
    for changes in candidates:
        try:
            new = apply_changes(spec, changes) if changes else spec
        except SpecError:
            if not skip_refused:
                raise
            continue
        out.append((_speed_key(spec, new, changes), changes, new, estimate_memory(new, devices=devices).total_bytes))
    return sorted(out, key=lambda item: item[0])


def _fitting(spec: JobSpec, scored: list[Scored], budget: int, group: Callable[[JobSpec], Hashable]) -> list[PlanEntry]:
    """The fastest fitting candidate of each ``group``, in speed order."""
    entries: list[PlanEntry] = []
    kept: set[Hashable] = set()
    for _, changes, new, total in scored:
        if total <= budget and group(new) not in kept:
            kept.add(group(new))
            reason = _reason(spec, new, changes, total, budget)
            entries.append(PlanEntry(changes=changes, spec=new, estimate_total_bytes=total, reason=reason))
    return entries
