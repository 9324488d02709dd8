"""Job requests and the job as the API shows it."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any, Self

from pydantic import BaseModel, ConfigDict, Field, ValidatorFunctionWrapHandler, model_validator

from api.schemas.common import UtcDatetime, as_json_types, as_utc
from api.schemas.examples import EXAMPLE_JOB_CREATE
from api.schemas.preflight import AutoChoiceOut
from api.spec_limits import check_document
from service_core.db.models import Job
from service_core.status import ErrorReason, JobStatus, reason_or_internal
from service_core.usage import charged_seconds, cost_of, device_hours, predicted_device_hours
from trainer_core.spec import JobSpec

# The worker's scale (service_core.queue.MIN_PRIORITY..MAX_PRIORITY; a test pins them equal).
MIN_PRIORITY, MAX_PRIORITY = 0, 9
QUEUE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
# The estimate's parts shown beside the worker's measurement of the same quantities.
MEMORY_SIDE_BY_SIDE = (
    "parameter_bytes",
    "gradient_bytes",
    "optimizer_state_bytes",
    "activation_bytes",
    "total_bytes",
    "gpu_memory_bytes",
    "fits",
)


class JobCreate(JobSpec):
    """The job spec itself, plus where and how urgently to run it."""

    model_config = ConfigDict(
        # Only examples that work as they stand: an uploaded dataset's id exists only after its upload.
        json_schema_extra={"examples": [EXAMPLE_JOB_CREATE]},
    )

    priority: int = Field(
        default=MIN_PRIORITY, ge=MIN_PRIORITY, le=MAX_PRIORITY, description="0..9, higher starts first."
    )
    queue: str | None = Field(
        default=None, pattern=QUEUE_PATTERN, description="Worker queue; default: the service's default queue."
    )

    @model_validator(mode="before")
    @classmethod
    def _bounded(cls, data: Any) -> Any:
        return check_document(data)

    @model_validator(mode="wrap")
    @classmethod
    def _json_types(cls, data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return as_json_types(cls, data, handler)

    def job_spec(self) -> JobSpec:
        """The spec alone, as submitted (unset fields stay unset, so re-validation agrees)."""
        return JobSpec.model_validate(self.model_dump(exclude={"priority", "queue"}, exclude_unset=True))


class Progress(BaseModel):
    step: int
    total: int | None
    epoch: float | None
    fraction: float | None = Field(description="step / total, when the total is known.")


class JobError(BaseModel):
    reason: ErrorReason | None = Field(description="Why the job ended: see Failure reasons in the README.")
    message: str | None


class MemoryComparison(BaseModel):
    estimated: dict[str, Any] | None = Field(description="The estimate's headline figures (bytes).")
    measured: dict[str, Any] | None = Field(description="What the run measured (bytes), once it reported.")


class TimeComparison(BaseModel):
    predicted_s: float | None = Field(description="The estimate's training seconds (median), when it made one.")
    p10_s: float | None = None
    p90_s: float | None = None
    calibrated: bool | None = Field(default=None, description="Whether the queue's own finished jobs set the rate.")
    measured_s: float | None = Field(default=None, description="What the run measured (its last session), once done.")


class JobUsage(BaseModel):
    """What the job is charged so far beside what was predicted (service_core/usage.py)."""

    devices: int = Field(description="Devices each attempt holds (resources.num_nodes x num_processes).")
    run_seconds: float = Field(description="Seconds in `running` over every attempt, the current one included.")
    device_hours: float = Field(description="run_seconds × devices / 3600: what the job is charged.")
    price_per_device_hour: float | None = Field(description="The queue's price when the job was submitted.")
    cost: float | None = Field(description="device_hours × price; null for a queue without a price.")
    predicted_device_hours: float | None = Field(description="The time estimate's seconds × devices / 3600.")
    predicted_cost: float | None = None


class JobLinks(BaseModel):
    self: str
    events: str
    metrics: str
    artifacts: str
    cancel: str


class JobSummary(BaseModel):
    """A job as lists show it: everything but its spec (fetch one job for that)."""

    id: str
    name: str
    owner: str
    status: JobStatus
    queue: str
    priority: int
    estimate: dict[str, Any] | None
    progress: Progress
    latest_metrics: dict[str, Any] | None
    final_metrics: dict[str, Any] | None
    memory: MemoryComparison
    time: TimeComparison | None = Field(default=None, description="Predicted training time beside the measured.")
    usage: JobUsage | None = Field(default=None, description="Device-hours and cost charged, beside the predicted.")
    error: JobError | None
    waiting: str | None = Field(
        default=None,
        description="Why a queued job has not started although a slot could take it, when the service holds it "
        "back (its owner's running-jobs cap, TRAINJOBS_MAX_RUNNING_PER_OWNER), or how a multi-node job's gang "
        "stands (forming, or waiting for free workers); null otherwise.",
    )
    attempts: int
    retries: list[dict[str, Any]] = Field(
        default_factory=list,
        description="Attempts that ran out of device memory (job detail only): step, micro-batch, changes made.",
    )
    cancel_requested: bool
    pause_requested: bool = Field(
        default=False, description="A pause of the running job is under way: it checkpoints, then becomes `paused`."
    )
    created_at: UtcDatetime
    started_at: UtcDatetime | None
    finished_at: UtcDatetime | None
    updated_at: UtcDatetime
    links: JobLinks

    @classmethod
    def from_job(cls, job: Job) -> Self:
        return cls(**summary_fields(job))


class TrackerLink(BaseModel):
    """Where a job's run is in W&B or MLflow, as its run reported it (trainer_core/trackers.py)."""

    url: str | None = Field(description="The run's page; None for an offline W&B run or a local MLflow store.")
    run_id: str
    experiment_id: str | None = Field(default=None, description="MLflow only.")
    dir: str | None = Field(default=None, description="W&B only: the run's files on the worker (`wandb sync` them).")


class StartedFromOut(BaseModel):
    """Where a job started: another job's checkpoint."""

    job: str
    checkpoint: int = Field(description="The step of the checkpoint it started from.")
    url: str


class NodeOut(BaseModel):
    """One node of a multi-node job's gang (worker/gang.py)."""

    node: int | None = Field(description="Its rank among the nodes; null while the gang forms.")
    host: str = Field(description="The worker host its slot runs on.")
    worker: str = Field(description="The worker (host and main process id) the slot belongs to.")
    address: str = Field(description="Where the other nodes reach it (TRAINJOBS_ADVERTISE_HOST).")
    port: int = Field(description="The port it picked; node 0's `address:port` is the run's rendezvous endpoint.")


class JobOut(JobSummary):
    """One job, with the spec it runs (as stored: locations resolved)."""

    spec: dict[str, Any]
    tracker_links: dict[str, TrackerLink] | None = Field(
        default=None, description="The W&B / MLflow runs of `training.report_to`, by tracker, once the run started."
    )
    auto: list[AutoChoiceOut] | None = Field(
        default=None, description="The values the service chose at submit for fields written `auto`, with why."
    )
    started_from: StartedFromOut | None = Field(
        default=None, description="The job and checkpoint this one started from (`init_from`, the step resolved)."
    )
    continued_by: list[str] = Field(
        default_factory=list, description="The jobs started from this job's checkpoints, oldest first (up to 100)."
    )
    nodes: list[NodeOut] = Field(
        default_factory=list,
        description="A job of several nodes (`resources.num_nodes`): the worker slots of its gang, running or forming.",
    )

    @classmethod
    def from_job(cls, job: Job) -> Self:
        links = {name: TrackerLink.model_validate(link) for name, link in (job.tracker_links or {}).items()}
        auto = [AutoChoiceOut.model_validate(choice) for choice in job.auto_choices or []] or None
        init = job.spec.get("init_from") or {}
        started = None
        if (source := job.init_from_job) is not None:
            started = StartedFromOut(job=source, checkpoint=int(init["checkpoint"]), url=f"/v1/jobs/{source}")
        return cls(**summary_fields(job), spec=job.spec, tracker_links=links or None, auto=auto, started_from=started)


def summary_fields(job: Job) -> dict[str, Any]:
    """The fields of a JobSummary from a job row (the spec is not read, so a list may defer it)."""
    base = f"/v1/jobs/{job.id}"
    total = job.progress_total
    estimated = None
    if job.estimate is not None:
        estimated = {k: job.estimate[k] for k in MEMORY_SIDE_BY_SIDE if k in job.estimate}
    error = None
    if job.error_reason is not None or job.error_message is not None:
        reason = reason_or_internal(job.error_reason) if job.error_reason is not None else None
        error = JobError(reason=reason, message=job.error_message)
    return dict(
        id=job.id,
        name=job.name,
        owner=job.owner,
        status=JobStatus(job.status),
        queue=job.queue,
        priority=job.priority,
        estimate=job.estimate,
        progress=Progress(
            step=job.progress_step,
            total=total,
            epoch=job.epoch,
            fraction=min(1.0, job.progress_step / total) if total else None,
        ),
        latest_metrics=job.latest_metrics,
        final_metrics=job.final_metrics,
        memory=MemoryComparison(estimated=estimated, measured=job.measured_memory),
        time=time_comparison(job),
        usage=job_usage(job),
        error=error,
        waiting=job.waiting_reason if job.status == JobStatus.queued.value else None,
        attempts=job.attempts,
        cancel_requested=job.cancel_requested,
        pause_requested=job.pause_requested,
        created_at=job.created_at,
        started_at=job.started_at,
        finished_at=job.finished_at,
        updated_at=job.updated_at,
        links=JobLinks(
            self=base,
            events=f"{base}/events",
            metrics=f"{base}/metrics",
            artifacts=f"{base}/artifacts",
            cancel=f"{base}/cancel",
        ),
    )


class JobList(BaseModel):
    items: list[JobSummary]
    next_cursor: str | None = Field(description="Pass as `cursor` for the next (older) page; null at the end.")


class MetricPointOut(BaseModel):
    seq: int
    step: int
    epoch: float | None
    name: str
    value: float | None
    time: UtcDatetime


class MetricPage(BaseModel):
    items: list[MetricPointOut]
    next_after: int = Field(description="Pass as `after` to continue; equal to `after` when nothing new.")
    has_more: bool


class CheckpointOut(BaseModel):
    step: int
    epoch: float | None = Field(description="The epoch at the newest training-loss point at or before the step.")
    loss: float | None = Field(description="The training loss at the newest logging step at or before this one.")
    eval_step: int | None = Field(description="The step of the newest evaluation at or before this one.")
    eval_metrics: dict[str, float | None] = Field(description="That evaluation's values (empty without one).")
    size: int = Field(description="Bytes, every file of the checkpoint (the optimizer state included).")
    created_at: UtcDatetime = Field(description="When the checkpoint was complete (in the store, for an object store).")
    is_best: bool = Field(description="The best of the job's checkpoints by `best_metric`.")
    kept: bool = Field(description="Whether retention keeps it: the newest `save_total_limit` are kept.")
    download_url: str


class CheckpointList(BaseModel):
    items: list[CheckpointOut] = Field(description="Every complete checkpoint, oldest first.")
    best_metric: str
    greater_is_better: bool
    save_total_limit: int | None


# `<created_at in microseconds since the epoch>-<job id>`: every string of this form is a position in
# the list (an unknown one simply starts the page there), so the schema's pattern is exactly what the
# API accepts. 17 digits reach the year 5138, well inside what datetime holds.
CURSOR_PATTERN = r"^[0-9]{1,17}-[0-9a-f]{32}$"
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_MICROSECOND = timedelta(microseconds=1)


class Cursor(BaseModel):
    """The keyset position of a list page (opaque to clients)."""

    created_at: datetime
    id: str

    def encode(self) -> str:
        return f"{(as_utc(self.created_at) - _EPOCH) // _MICROSECOND}-{self.id}"

    @classmethod
    def decode(cls, text: str) -> Self:
        """The position a string matching CURSOR_PATTERN names (the route has checked the pattern)."""
        micros, _, job_id = text.partition("-")
        return cls(created_at=_EPOCH + int(micros) * _MICROSECOND, id=job_id)


def time_comparison(job: Job) -> TimeComparison | None:
    """The time estimate stored at submit beside the run's own ``train_runtime_s``."""
    predicted = (job.estimate or {}).get("time")
    if not predicted:
        return None
    measured = (job.final_metrics or {}).get("train_runtime_s")
    return TimeComparison(
        predicted_s=predicted.get("seconds"),
        p10_s=predicted.get("seconds_p10"),
        p90_s=predicted.get("seconds_p90"),
        calibrated=predicted.get("calibration", {}).get("calibrated"),
        measured_s=float(measured) if measured is not None else None,
    )


def job_usage(job: Job) -> JobUsage:
    """The charge so far (the running attempt up to now) beside the prediction stored at submit."""
    devices = job.devices or 1
    seconds = charged_seconds(job)
    hours = device_hours(seconds, devices)
    predicted = predicted_device_hours(job.estimate, devices)
    price = job.price_per_device_hour
    return JobUsage(
        devices=devices, run_seconds=seconds, device_hours=hours, price_per_device_hour=price,
        cost=cost_of(hours, price), predicted_device_hours=predicted,
        predicted_cost=None if predicted is None else cost_of(predicted, price),
    )  # fmt: skip
