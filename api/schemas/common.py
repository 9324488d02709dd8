"""Types shared by the response models."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field


def as_utc(value: datetime) -> datetime:
    # SQLite hands back naive datetimes; every time we store is UTC.
    return value if value.tzinfo is not None else value.replace(tzinfo=UTC)


UtcDatetime = Annotated[datetime, AfterValidator(as_utc)]


class FieldProblem(BaseModel):
    field: str = Field(description="Dotted path of the field to fix, e.g. `efficiency.local_sgd_steps`.")
    message: str
    type: str | None = None


class ProblemDetails(BaseModel):
    """RFC 9457 problem details, as every error of this API is sent (``application/problem+json``)."""

    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={
            "examples": [
                {
                    "type": "urn:trainjobs:problem:validation",
                    "title": "Invalid request",
                    "status": 422,
                    "detail": "efficiency.local_sgd_steps: local SGD belongs to the 'accelerate' backend",
                    "errors": [
                        {
                            "field": "efficiency.local_sgd_steps",
                            "message": "local SGD belongs to the 'accelerate' backend",
                            "type": "invalid_combination",
                        }
                    ],
                }
            ]
        },
    )

    type: str = "about:blank"
    title: str
    status: int
    detail: str | None = None
    errors: list[FieldProblem] | None = None


def problem_responses(*statuses: int) -> dict[int | str, dict[str, object]]:
    """OpenAPI ``responses`` entries documenting problem+json bodies for ``statuses``."""
    return {
        status: {"model": ProblemDetails, "content": {"application/problem+json": {}}, "description": description}
        for status, description in _DESCRIPTIONS.items()
        if status in statuses
    }


_DESCRIPTIONS = {
    401: "Missing or wrong API key.",
    403: "The key may not do this (e.g. list another owner's jobs without admin rights).",
    404: "No such resource, or it belongs to another owner.",
    409: "Conflict with the resource's state.",
    413: "Upload over the size limit.",
    422: "Invalid input; `errors` names each field.",
    429: "Too many at once (e.g. open event streams); `Retry-After` says when to try again.",
    503: "A dependency (database, broker) is unreachable.",
}
