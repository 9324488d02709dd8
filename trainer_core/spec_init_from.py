"""The ``init_from`` section of the job spec: start a new run from another run's checkpoint.

Kept apart from :mod:`trainer_core.spec` like the adapter section: the spec imports it. The run's side
is :mod:`trainer_core.init_from`. A checkpoint is named two ways:

* ``job`` and ``checkpoint`` (a step, ``best`` or ``last``): another job of the service. The API checks
  it at submit and stores the step it resolved to; the worker fetches that checkpoint and fills in
  ``path`` for the run (the run itself knows nothing of jobs).
* ``path``: a checkpoint folder on this machine (``output/checkpoint-40``), for runs without the service.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

from pydantic import Field, field_validator, model_validator

from trainer_core.spec_adapter import AdapterSpec
from trainer_core.spec_base import StrictModel, combination_error

CheckpointName = Literal["best", "last"]


class InitFromSpec(StrictModel):
    """Weights (and, when asked, the optimizer state) from another run's checkpoint; the new run has its
    own data, schedule and steps. A full model, or an adapter on the same base."""

    job: str | None = Field(
        default=None, min_length=1, max_length=32, pattern=r"^[A-Za-z0-9_-]+$",
        description="The service's job to start from (one of yours).",
    )  # fmt: skip
    checkpoint: int | CheckpointName = Field(
        default="last", description="With `job`: a checkpoint's step, `best` (by the job's metric_for_best_model) or "
        "`last`. The service stores the step it resolved to.",
    )  # fmt: skip
    path: str | None = Field(
        default=None, min_length=1, max_length=4096,
        description="A checkpoint folder on this machine (runs without the service). The service fills it in.",
    )  # fmt: skip
    resume_optimizer: bool = Field(
        default=False, description="Also take the checkpoint's optimizer state (moments, step counts) when its "
        "shapes match this run's; the learning rate and schedule stay this run's own.",
    )  # fmt: skip

    @field_validator("checkpoint", mode="before")
    @classmethod
    def _one_checkpoint_error(cls, value: Any) -> Any:
        # One message rather than one per member of the union.
        if isinstance(value, bool) or not isinstance(value, int | str) or (
            isinstance(value, str) and value not in get_args(CheckpointName) and not value.isdigit()
        ):
            raise ValueError("a checkpoint's step, 'best' or 'last'")
        return value

    @model_validator(mode="after")
    def _a_source(self) -> InitFromSpec:
        if self.job is None and self.path is None:
            raise combination_error("init_from.job", "name the job to start from (or, without the service, a path)")
        if isinstance(self.checkpoint, int) and self.checkpoint < 0:
            raise combination_error("init_from.checkpoint", "a step is 0 or more")
        return self


def adapter_mismatch(adapter: AdapterSpec | None, held: dict[str, Any]) -> str | None:
    """Why an adapter with config ``held`` (PEFT's ``r`` and ``target_modules``) cannot continue in a
    spec's ``adapter`` section, or None: the run's check of a checkpoint folder (trainer_core/init_from.py)
    and the API's of another job's spec at submit (which imports no torch)."""
    if adapter is None:
        return "the checkpoint holds a LoRA adapter: give an `adapter` section with its rank and targets"
    if int(held.get("r") or 0) != adapter.r:
        return f"the checkpoint's adapter has rank {held.get('r')}; adapter.r is {adapter.r}"
    targets = held.get("target_modules")
    mine = adapter.target_modules
    if isinstance(targets, list | str) and not _same_targets(targets, mine):
        return f"the checkpoint's adapter targets {targets}; adapter.target_modules is {mine}"
    return None


def _same_targets(theirs: list[str] | str, mine: list[str] | str) -> bool:
    # PEFT stores an "all-linear" request as the module names it resolved to, so that spelling matches any.
    if "all-linear" in (theirs, mine):
        return True
    return sorted([theirs] if isinstance(theirs, str) else theirs) == sorted([mine] if isinstance(mine, str) else mine)
