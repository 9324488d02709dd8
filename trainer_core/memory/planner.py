"""``plan_memory``: which settings make a job fit a device budget, fastest first.

It varies the optimizer (every entry of ``trainer_core.optimizers.OPTIMIZER_TABLE``), the micro-batch
(halved while even, with gradient accumulation doubled so the effective batch is unchanged), gradient
checkpointing (only where the model supports it) and mixed precision, and estimates every combination. For each
(optimizer, precision) pair it keeps the fastest combination that fits, then orders entries by expected
speed: no recomputation first, then larger micro-batches, then the fewest changes to the spec, then
16-bit autocast before fp32 (tensor cores), then the table's ``plan_rank`` (adamw, adamw_8bit,
adafactor: extra work per step).
"""

from __future__ import annotations

import itertools
from typing import Any

from pydantic import BaseModel

from trainer_core.memory.estimator import GIB, estimate_memory, human_bytes
from trainer_core.memory.parameters import model_structure
from trainer_core.optimizers import OPTIMIZER_TABLE, planner_order
from trainer_core.spec import JobSpec, OptimizerSpec, parse_spec


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
        section, field = path.split(".", 1)
        if path == "optimizer.name":
            data["optimizer"] = _optimizer_dict(spec.optimizer, value)
        elif path != "optimizer.amsgrad":  # dropped with the switch to an optimizer without it
            data.setdefault(section, {})[field] = value
    return parse_spec(data)


def _candidates(spec: JobSpec, checkpointing_ok: bool) -> list[dict[str, Any]]:
    """Every combination, as changes relative to ``spec`` (an empty dict is the spec itself)."""
    b0 = spec.training.per_device_train_batch_size
    ga0 = spec.efficiency.gradient_accumulation_steps
    halvings = [0]
    while b0 % 2 ** (halvings[-1] + 1) == 0:
        halvings.append(halvings[-1] + 1)
    precisions = list(dict.fromkeys([spec.efficiency.mixed_precision, "bf16", "no"]))
    ckpts = [False, True] if checkpointing_ok else [False]
    out = []
    for opt, k, ckpt, mp in itertools.product(planner_order(), halvings, ckpts, precisions):
        wanted: dict[str, Any] = {
            "optimizer.name": opt,
            "training.per_device_train_batch_size": b0 // 2**k,
            "efficiency.gradient_accumulation_steps": ga0 * 2**k,
            "efficiency.gradient_checkpointing": ckpt,
            "efficiency.mixed_precision": mp,
        }
        current = {
            "optimizer.name": spec.optimizer.name,
            "training.per_device_train_batch_size": b0,
            "efficiency.gradient_accumulation_steps": ga0,
            "efficiency.gradient_checkpointing": spec.efficiency.gradient_checkpointing,
            "efficiency.mixed_precision": spec.efficiency.mixed_precision,
        }
        changes = {key: value for key, value in wanted.items() if current[key] != value}
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
    if "efficiency.mixed_precision" in changes:
        mp = new.efficiency.mixed_precision
        phrases.append("fp32, no autocast" if mp == "no" else f"{mp} autocast (16-bit activations)")
    what = "; ".join(phrases) or "fits as it is"
    return f"{what}: {human_bytes(total)} of {human_bytes(budget)}"


def plan_memory(spec: JobSpec, gpu_memory_gb: float, *, devices: int | None = None) -> Plan:
    """Configurations of ``spec`` that fit ``gpu_memory_gb`` (GiB) per device, fastest first."""
    budget = int(gpu_memory_gb * GIB)
    structure = model_structure(spec.model, spec.task)
    scored = []
    for changes in _candidates(spec, structure.supports_gradient_checkpointing):
        new = apply_changes(spec, changes) if changes else spec
        total = estimate_memory(new, devices=devices).total_bytes
        scored.append((_speed_key(spec, new, changes), changes, new, total))
    scored.sort(key=lambda item: item[0])
    entries: list[PlanEntry] = []
    kept: set[tuple[str, str]] = set()
    for _, changes, new, total in scored:
        pair = (new.optimizer.name, new.efficiency.mixed_precision)
        if total <= budget and pair not in kept:  # slower variants of a pair that fits are noise
            kept.add(pair)
            reason = _reason(spec, new, changes, total, budget)
            entries.append(PlanEntry(changes=changes, spec=new, estimate_total_bytes=total, reason=reason))
    smallest = min(scored, key=lambda item: (item[3], item[0]))
    return Plan(budget_bytes=budget, entries=entries, minimum_total_bytes=smallest[3], minimum_changes=smallest[1])
