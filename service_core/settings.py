"""The service's one settings object (pydantic-settings), shared by the API, the worker and the launcher.

Every variable is documented in the README. Defaults are the embedded ones: a SQLite database, the
embedded (SQLAlchemy/SQLite) Celery broker and local artifacts, all under ``TRAINJOBS_HOME`` (./var).
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from trainer_core.memory_overhead import OVERHEAD_ENV
from trainer_core.time_estimate import DEVICES

DEV_SECRET = "dev-insecure-secret-change-me"


class Settings(BaseSettings):
    # populate_by_name also makes pydantic-settings read each field's *name* from the environment
    # (HOME -> home, ENV -> env); the prefix (applied to names only) keeps those out.
    model_config = SettingsConfigDict(env_prefix="TRAINJOBS_FIELD_", extra="ignore", populate_by_name=True)

    env: Literal["dev", "production"] = Field(default="dev", validation_alias="TRAINJOBS_ENV")
    home: Path = Field(default=Path("var"), validation_alias="TRAINJOBS_HOME")
    database_url_: str | None = Field(default=None, validation_alias="DATABASE_URL")
    broker_url_: str | None = Field(default=None, validation_alias="BROKER_URL")
    artifacts_root_: str | None = Field(default=None, validation_alias="ARTIFACTS_ROOT")
    # A local folder, or an fsspec URL (s3://bucket/prefix) read with the standard AWS variables.
    data_root_: str | None = Field(default=None, validation_alias="DATA_ROOT")
    secret_key: str = Field(default=DEV_SECRET, validation_alias="TRAINJOBS_SECRET_KEY")
    api_key: str | None = Field(default=None, validation_alias="TRAINJOBS_API_KEY")
    max_upload_mb: int = Field(default=1024, ge=1, validation_alias="TRAINJOBS_MAX_UPLOAD_MB")
    # Every other request body (job specs, estimates): refused with 413 before it is parsed.
    max_json_kb: int = Field(default=1024, ge=1, validation_alias="TRAINJOBS_MAX_JSON_KB")
    # The longest a run may train: the ceiling on, and the default of, resources.max_runtime_minutes
    # (api/spec_limits.py). The broker must not redeliver a job while it still runs: its visibility
    # timeout is this plus an hour.
    max_job_hours: float = Field(default=72.0, gt=0, validation_alias="TRAINJOBS_MAX_JOB_HOURS")
    cancel_grace_seconds: float = Field(default=30.0, ge=0, validation_alias="TRAINJOBS_CANCEL_GRACE_SECONDS")
    default_queue: str = Field(default="default", validation_alias="TRAINJOBS_DEFAULT_QUEUE")
    # queue name -> per-device GPU memory budget in GB, e.g. {"gpu-24g": 24, "gpu-80g": 80}
    queue_budgets: dict[str, float] = Field(default_factory=dict, validation_alias="TRAINJOBS_QUEUE_BUDGETS")
    # queue name -> the device its workers train on, a name of trainer_core.time_estimate.DEVICES,
    # e.g. {"gpu-80g": "H100-SXM"}: the peak the time estimate scales (issue 29)
    queue_devices: dict[str, str] = Field(default_factory=dict, validation_alias="TRAINJOBS_QUEUE_DEVICES")
    # queue name -> price per device-hour, e.g. {"gpu-80g": 2.5}: the predicted and charged cost of its
    # jobs (service_core/usage.py); a queue without a price has no cost
    queue_prices: dict[str, float] = Field(default_factory=dict, validation_alias="TRAINJOBS_QUEUE_PRICES")
    # owner -> device-hours a UTC month ("*": every owner not named), or one number for every owner;
    # a submit whose predicted device-hours exceed what is left is a 429 (service_core/usage.py)
    owner_monthly_device_hours: dict[str, float] = Field(
        default_factory=dict, validation_alias="TRAINJOBS_OWNER_MONTHLY_DEVICE_HOURS"
    )
    memory_overhead_mb: int | None = Field(default=None, ge=0, validation_alias=OVERHEAD_ENV)  # MiB
    # Fault tolerance (README "Operations"): a running job's heartbeat lease, the sweep that requeues
    # expired ones, and how old a queued job's message must be before the sweep re-sends it.
    lease_seconds: float = Field(default=60.0, gt=0, validation_alias="TRAINJOBS_LEASE_SECONDS")
    lease_renew_seconds: float = Field(default=10.0, gt=0, validation_alias="TRAINJOBS_LEASE_RENEW_SECONDS")
    sweep_seconds: float = Field(default=30.0, gt=0, validation_alias="TRAINJOBS_SWEEP_SECONDS")
    redeliver_after_seconds: float = Field(default=60.0, gt=0, validation_alias="TRAINJOBS_REDELIVER_AFTER_SECONDS")
    # Multi-node jobs (worker/gang.py): how long the slots that joined a gang wait for the rest before
    # they let go (the job stays queued, its waiting reason says why), and the address this host's
    # nodes are reached at by the others (unset: the address this host reaches the database from).
    gang_wait_seconds: float = Field(default=120.0, gt=0, validation_alias="TRAINJOBS_GANG_WAIT_SECONDS")
    advertise_host: str | None = Field(default=None, validation_alias="TRAINJOBS_ADVERTISE_HOST")
    # The ports node 0 picks its rendezvous port from ("29400-29499"; unset: any free port), for a firewall.
    rendezvous_ports: str | None = Field(
        default=None, pattern=r"^\d{1,5}-\d{1,5}$", validation_alias="TRAINJOBS_RENDEZVOUS_PORTS"
    )
    # Testing aid and private deployments only: lifts the public-address rule (trainer_core/net_guard.py)
    # for webhook URLs and for tracker URIs named in specs, so a receiver or an MLflow server on this
    # machine or a private network can be reached. Off unless set.
    allow_private_targets: bool = Field(default=False, validation_alias="TRAINJOBS_ALLOW_PRIVATE_TARGETS")
    # Where users reach this service (https://trainjobs.example.com): makes webhook payloads' dashboard_url
    # absolute. Unset: a path (/dashboard#/jobs/ID) the receiver joins to the address it knows.
    public_url: str | None = Field(default=None, validation_alias="TRAINJOBS_PUBLIC_URL")
    # Webhook sending (worker/webhook_sender.py): how often each worker looks for due deliveries, and the
    # first retry wait (doubled per attempt, full jitter, capped at an hour). Tuning and testing aids.
    webhook_poll_seconds: float = Field(default=2.0, gt=0, validation_alias="TRAINJOBS_WEBHOOK_POLL_SECONDS")
    webhook_backoff_seconds: float = Field(default=5.0, gt=0, validation_alias="TRAINJOBS_WEBHOOK_BACKOFF_SECONDS")
    # How long an API process trusts a key it has checked; a revocation takes effect within this time.
    auth_cache_seconds: float = Field(default=10.0, ge=0, validation_alias="TRAINJOBS_AUTH_CACHE_SECONDS")
    # A worker slot forks its runs from a parent that has imported torch and transformers already
    # (worker/forkserver.py): seconds off every run's start, for one idle process per slot.
    prewarm_runs: bool = Field(default=True, validation_alias="TRAINJOBS_PREWARM_RUNS")
    # Testing aid: the socket of a `python -m worker.zygote --parent PATH` that forks each slot's zygote
    # ready-imported, instead of every slot importing its own (the suite starts ~40 workers).
    zygote_parent: str | None = Field(default=None, validation_alias="TRAINJOBS_ZYGOTE_PARENT")
    # Testing aid: the socket of a `python -m worker.service_parent PATH` that forks API processes, workers
    # and slots ready-imported. Read from the environment where a process starts another
    # (worker/processes.py:spawn_child has no settings); here for the table of settings.
    service_parent: str | None = Field(default=None, validation_alias="TRAINJOBS_SERVICE_PARENT")
    # Open event streams (GET /v1/jobs/{id}/events) per owner and in all, per API process; beyond: 429.
    max_streams_per_owner: int = Field(default=16, ge=1, validation_alias="TRAINJOBS_MAX_STREAMS_PER_OWNER")
    max_streams: int = Field(default=256, ge=1, validation_alias="TRAINJOBS_MAX_STREAMS")
    # Per-owner quotas (0: none). Rates are per API process; over a quota: 429 with Retry-After.
    max_queued_per_owner: int = Field(default=10_000, ge=0, validation_alias="TRAINJOBS_MAX_QUEUED_PER_OWNER")
    # Jobs of one owner running at once, all workers together (0: as many as there are slots). Enforced
    # by the worker's claim (worker/running_cap.py): a job over it waits in the queue, it is not refused.
    max_running_per_owner: int = Field(default=0, ge=0, validation_alias="TRAINJOBS_MAX_RUNNING_PER_OWNER")
    submits_per_minute: int = Field(default=3000, ge=0, validation_alias="TRAINJOBS_SUBMITS_PER_MINUTE")
    uploads_per_minute: int = Field(default=60, ge=0, validation_alias="TRAINJOBS_UPLOADS_PER_MINUTE")
    # When set, GET /metrics needs `Authorization: Bearer <this token>` (unset: open, keep it private).
    metrics_token: str | None = Field(default=None, validation_alias="TRAINJOBS_METRICS_TOKEN")

    @model_validator(mode="after")
    def _renew_within_lease(self) -> Settings:
        if self.lease_renew_seconds >= self.lease_seconds:
            raise ValueError("TRAINJOBS_LEASE_RENEW_SECONDS must be shorter than TRAINJOBS_LEASE_SECONDS")
        return self

    @field_validator("data_root_", mode="before")
    @classmethod
    def _data_root_text(cls, value: object) -> object:
        # A Path (or a file:// URL) is a local folder; any other URL must name a known fsspec protocol.
        if isinstance(value, Path):
            return str(value)
        if isinstance(value, str) and "://" in value:
            protocol = value.split("://", 1)[0].lower()
            if protocol in ("file", "local"):
                return value.split("://", 1)[1]
            import fsspec

            try:
                fsspec.get_filesystem_class(protocol)
            except (ValueError, ImportError) as exc:
                raise ValueError(f"DATA_ROOT: {exc}") from exc
            return value.rstrip("/")
        return value

    @field_validator("queue_budgets", "queue_devices", "queue_prices", "owner_monthly_device_hours", mode="before")
    @classmethod
    def _parse_json_maps(cls, value: object) -> object:
        return json.loads(value) if isinstance(value, str) else value

    @field_validator("owner_monthly_device_hours", mode="before")
    @classmethod
    def _one_budget_for_all(cls, value: object) -> object:
        # pydantic-settings has decoded the variable's JSON already: a bare number is every owner's budget
        return {"*": value} if isinstance(value, int | float) and not isinstance(value, bool) else value

    @field_validator("queue_prices", "owner_monthly_device_hours")
    @classmethod
    def _not_negative(cls, value: dict[str, float]) -> dict[str, float]:
        if negative := sorted(k for k, v in value.items() if v < 0):
            raise ValueError(f"negative values for {', '.join(negative)}")
        return value

    @field_validator("queue_devices")
    @classmethod
    def _known_devices(cls, value: dict[str, str]) -> dict[str, str]:
        unknown = sorted(set(value.values()) - set(DEVICES))
        if unknown:
            raise ValueError(f"unknown device(s) {unknown}; known: {', '.join(DEVICES)}")
        return value

    @property
    def database_url(self) -> str:
        return self.database_url_ or f"sqlite:///{(self.home / 'trainjobs.db').resolve()}"

    @property
    def broker_url(self) -> str:
        # kombu's SQLAlchemy transport on a SQLite file: an embedded broker with no server to run.
        return self.broker_url_ or f"sqla+sqlite:///{(self.home / 'broker.db').resolve()}"

    @property
    def artifacts_root(self) -> str:
        return self.artifacts_root_ or str((self.home / "artifacts").resolve())

    @property
    def data_root_url(self) -> str:
        """``DATA_ROOT`` as a location: an fsspec URL as given, or the absolute local folder."""
        if self.data_root_ is not None and "://" in self.data_root_:
            return self.data_root_
        return self.data_root.as_posix()

    @property
    def data_root(self) -> Path:
        """The local data root folder; an object-store ``DATA_ROOT`` has none (use ``data_root_url``)."""
        if self.data_root_ is not None and "://" in self.data_root_:
            raise ValueError(f"DATA_ROOT is {self.data_root_}, not a local folder")
        return (Path(self.data_root_) if self.data_root_ else self.home / "data").resolve()

    @property
    def visibility_timeout_s(self) -> int:
        return int(self.max_job_hours * 3600) + 3600

    def check_production_ready(self) -> None:
        """Refuse to serve outside dev mode with a placeholder secret or no admin key."""
        if self.env == "dev":
            return
        problems = []
        if self.secret_key == DEV_SECRET or len(self.secret_key) < 16:
            problems.append("TRAINJOBS_SECRET_KEY is the default or shorter than 16 characters")
        if not self.api_key:
            problems.append("TRAINJOBS_API_KEY is unset")
        if problems:
            raise RuntimeError("refusing to start in production: " + "; ".join(problems))


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
