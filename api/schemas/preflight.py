"""What ``POST /v1/jobs?dry_run=true`` answers: the checks a submit would make, with nothing stored."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class AutoChoiceOut(BaseModel):
    """One value the service chose for a field the spec wrote as `auto`."""

    field: str = Field(description="The spec path, e.g. `training.learning_rate`.")
    value: float | int
    why: str


class DryRunOut(BaseModel):
    dry_run: bool = True
    queue: str
    spec: dict[str, Any] = Field(description="The spec as it would be stored (locations made absolute).")
    preflight: dict[str, Any] = Field(
        description="Checks done, splits with row counts (`exact` false: estimated from a head), the label set."
    )
    estimate: dict[str, Any] | None = Field(description="The memory estimate (None for a model the estimator lacks).")
    budget_gb: float | None = Field(description="The per-device budget that applies (spec's or queue's), if any.")
    plan: dict[str, Any] | None = Field(description="The planner's configurations under the budget, when there is one.")
    auto: list[AutoChoiceOut] | None = Field(
        default=None, description="The values `auto` chose (trainer_core/auto.py), each with why; in `spec` already."
    )
