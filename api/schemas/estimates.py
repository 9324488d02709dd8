"""Memory-estimate requests and answers (the figures come from ``trainer_core.memory``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidatorFunctionWrapHandler, model_validator

from api.schemas.common import as_json_types
from api.schemas.examples import EXAMPLE_ESTIMATE_REQUEST
from api.schemas.jobs import QUEUE_PATTERN
from api.schemas.preflight import AutoChoiceOut
from api.spec_limits import check_document
from trainer_core.spec import JobSpec


class EstimateRequest(BaseModel):
    model_config = ConfigDict(
        extra="forbid", allow_inf_nan=False, json_schema_extra={"examples": [EXAMPLE_ESTIMATE_REQUEST]}
    )

    spec: JobSpec

    @model_validator(mode="before")
    @classmethod
    def _bounded(cls, data: Any) -> Any:
        return check_document(data)

    @model_validator(mode="wrap")
    @classmethod
    def _json_types(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return as_json_types(cls, data, handler)

    gpu_memory_gb: float | None = Field(
        default=None, gt=0, le=4096, description="Per-device budget; with it the answer includes the planner's list."
    )
    devices: int | None = Field(
        default=None, ge=1, le=4096, description="Default: the spec's world size (resources.num_nodes x num_processes)."
    )
    train_rows: int | None = Field(
        default=None, ge=1, le=10**12, description="Rows to train on; with it the answer includes the `time` part "
        "(steps, seconds on the queue's device, the calibration used). A submit's dry run counts them itself.",
    )  # fmt: skip
    eval_rows: int = Field(default=0, ge=0, le=10**12, description="Rows to evaluate on (with `train_rows`).")
    queue: str | None = Field(
        default=None, pattern=QUEUE_PATTERN, description="The queue whose device and history time the job "
        "(default: the service's default queue).",
    )  # fmt: skip


class EstimateResponse(BaseModel):
    estimate: dict[str, Any] = Field(
        description="The estimator's breakdown: parts with formulas, total_bytes (summed as total_formula says), fits."
    )
    plan: dict[str, Any] | None = Field(description="Configurations that fit the budget, cheapest change first.")
    auto: list[AutoChoiceOut] | None = Field(
        default=None, description="Values chosen for fields written `auto` (epochs only with `train_rows`)."
    )


class Catalog(BaseModel):
    items: list[dict[str, Any]]
