"""The memory estimator as the API uses it: estimates for jobs, and the budget check on submit.

``trainer_core.memory`` loads torch and transformers configs, so it is imported on first use; the
routes call this inside ``run_in_threadpool``, so the event loop stays free while the estimator works
(a model's first estimate builds it on the meta device).
"""

from __future__ import annotations

import logging
from typing import Any

from api.problems import Problem
from service_core.settings import Settings
from trainer_core.memory_overhead import overhead_mb_to_bytes
from trainer_core.spec import JobSpec

logger = logging.getLogger(__name__)


def overhead_bytes(settings: Settings) -> int | None:
    """The overhead setting in bytes, or None to let the estimator read the same variable itself."""
    return None if settings.memory_overhead_mb is None else overhead_mb_to_bytes(settings.memory_overhead_mb)


def estimate(
    spec: JobSpec, settings: Settings, *, gpu_memory_gb: float | None = None, devices: int | None = None
) -> Any:
    """The estimator's MemoryEstimate (raises UnknownModelError, a SpecError, for models it cannot size)."""
    from trainer_core.memory import estimate_memory

    return estimate_memory(spec, devices=devices, gpu_memory_gb=gpu_memory_gb, overhead_bytes=overhead_bytes(settings))


def plan(spec: JobSpec, gpu_memory_gb: float, *, devices: int | None = None) -> Any:
    from trainer_core.memory import plan_memory

    return plan_memory(spec, gpu_memory_gb, devices=devices)


def budget_for(spec: JobSpec, queue: str, settings: Settings) -> float | None:
    """The tightest per-device budget that applies: the spec's own and the queue's, when set."""
    budgets = [b for b in (spec.resources.gpu_memory_gb, settings.queue_budgets.get(queue)) if b is not None]
    return min(budgets) if budgets else None


def estimate_for_submit(spec: JobSpec, queue: str, settings: Settings) -> dict[str, Any] | None:
    """The estimate to store with a job; a 422 with the planner's advice when it exceeds the budget.

    Without a budget an unknown model is not an error (the worker may still fetch it); with one,
    the job cannot be checked, so the estimator's error (naming ``model.name_or_path``) stands.
    """
    from trainer_core.memory import UnknownModelError

    budget = budget_for(spec, queue, settings)
    try:
        result = estimate(spec, settings, gpu_memory_gb=budget)
    except UnknownModelError:
        if budget is not None:
            raise
        logger.info("no memory estimate for job %r: model unknown to the estimator", spec.name)
        return None
    body: dict[str, Any] = result.model_dump(mode="json")
    if budget is not None and not result.fits:
        advice = plan(spec, budget).model_dump(mode="json")
        field = "resources.gpu_memory_gb" if spec.resources.gpu_memory_gb == budget else "queue"
        raise Problem(
            422,
            f"the job needs about {gib(result.total_bytes)} per device, over the {budget:g} GB budget; "
            + over_budget_advice(advice),
            title="Job does not fit in GPU memory",
            type_="urn:trainjobs:problem:over-budget",
            errors=[
                {"field": field, "message": f"the estimate exceeds the {budget:g} GB budget", "type": "over_budget"}
            ],
            estimate=body,
            plan=advice,
            budget_gb=budget,
        )
    return body


def gib(size: int) -> str:
    return f"{size / (1 << 30):.2f} GiB"


def changes_text(changes: dict[str, Any]) -> str:
    """``a.b=1, c=2`` (or ``no change``) for a plan's changes to the spec."""
    return ", ".join(f"{k}={v}" for k, v in changes.items()) or "no change"


def over_budget_advice(plan_body: dict[str, Any]) -> str:
    """What the planner found, truthfully: the first configuration that fits, or that none does and
    the smallest footprint it found, with the settings that reach it."""
    entries = plan_body["entries"]
    if entries:
        first = entries[0]
        return (
            f"`plan` lists {len(entries)} configuration(s) that fit, the first: {changes_text(first['changes'])} "
            f"({gib(first['estimate_total_bytes'])})"
        )
    return (
        f"nothing the planner tried fits; the smallest footprint found is {gib(plan_body['minimum_total_bytes'])} "
        f"with {changes_text(plan_body['minimum_changes'])}; use a queue with more memory or a smaller model"
    )
