"""Webhooks and their deliveries as the API shows them (the signing secret only when created or rotated)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, WithJsonSchema

from api.schemas.common import UtcDatetime
from service_core.db.models import Webhook, WebhookDelivery
from service_core.webhooks import DELIVERY_STATES, EVENT_TYPES


def _known_event(value: str) -> str:
    if value not in EVENT_TYPES:
        raise ValueError(f"unknown event type {value!r}; known: {', '.join(EVENT_TYPES)}")
    return value


# An item check rather than a Literal, so the list comes from service_core/webhooks.py alone; the
# schema still shows the enum (the dashboard reads it from there).
EventType = Annotated[str, AfterValidator(_known_event), WithJsonSchema({"type": "string", "enum": list(EVENT_TYPES)})]
DeliveryState = Annotated[str, WithJsonSchema({"type": "string", "enum": list(DELIVERY_STATES)})]


class WebhookCreate(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    url: str = Field(
        min_length=1, max_length=2048, examples=["https://example.com/hooks/trainjobs"],
        description="An http(s) URL on a public host (unless TRAINJOBS_ALLOW_PRIVATE_TARGETS is set).",
    )  # fmt: skip
    events: list[EventType] = Field(min_length=1, max_length=32, examples=[["job.succeeded", "job.failed"]])
    description: str = Field(default="", max_length=500)


class WebhookOut(BaseModel):
    id: str
    owner: str
    url: str
    events: list[str]
    description: str
    enabled: bool
    disabled_reason: str | None = Field(description="Why it stopped (the endpoint answered 410 Gone).")
    created_at: UtcDatetime

    @classmethod
    def from_row(cls, row: Webhook) -> WebhookOut:
        return cls(
            id=row.id, owner=row.owner, url=row.url, events=list(row.events), description=row.description,
            enabled=row.enabled, disabled_reason=row.disabled_reason, created_at=row.created_at,
        )  # fmt: skip


class WebhookCreated(WebhookOut):
    secret: str = Field(description="The signing secret (`whsec_...`): shown here and at rotation only.")


class WebhookList(BaseModel):
    items: list[WebhookOut]


class DeliveryOut(BaseModel):
    id: str
    event_type: str
    job_id: str | None
    state: DeliveryState
    attempts: int
    next_attempt_at: UtcDatetime
    created_at: UtcDatetime
    delivered_at: UtcDatetime | None
    attempt_log: list[dict[str, Any]] = Field(
        description='Every attempt: `{"at", "status_code", "error", "duration_ms"}`.'
    )
    payload: dict[str, Any] = Field(description="The JSON body sent (signed) to the webhook.")

    @classmethod
    def from_row(cls, row: WebhookDelivery) -> DeliveryOut:
        return cls(
            id=row.id, event_type=row.event_type, job_id=row.job_id, state=row.state, attempts=row.attempts,
            next_attempt_at=row.next_attempt_at, created_at=row.created_at, delivered_at=row.delivered_at,
            attempt_log=list(row.attempt_log), payload=row.payload,
        )  # fmt: skip


class DeliveryList(BaseModel):
    items: list[DeliveryOut]
