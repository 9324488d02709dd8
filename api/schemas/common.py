"""Types shared by the response models."""

from __future__ import annotations

from contextvars import ContextVar
from datetime import datetime
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidatorFunctionWrapHandler

from service_core.db.base import as_utc

# The largest sequence number or byte offset a query may name: the database's BIGINT and the file
# system's off_t. Beyond it SQLite and seek() fail with OverflowError (a 500), so routes bound them.
MAX_INT64 = 2**63 - 1
# A Last-Event-ID: the seq of an event, in decimal digits (18 digits stay under MAX_INT64).
EVENT_ID_PATTERN = r"^[0-9]{1,18}$"


UtcDatetime = Annotated[datetime, AfterValidator(as_utc)]

_STRICT_PASS: ContextVar[bool] = ContextVar("trainjobs_strict_pass", default=False)


def as_json_types(model: type[BaseModel], data: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """Validate a request body as its JSON schema types say: no `false` for an integer, no `1` or
    `"yes"` for a boolean. For a body model's ``model_validator(mode="wrap")``.

    FastAPI validates bodies in pydantic's lax mode, which turns `false` into 0 and `1` into True:
    requests the schema calls invalid were accepted. Strict mode holds for the whole body, nested
    sections included; specs read from YAML files (where `5e-5` is a string) stay lax.
    """
    if _STRICT_PASS.get():  # the strict pass below, arriving here again
        return handler(data)
    token = _STRICT_PASS.set(True)
    try:
        return model.__pydantic_validator__.validate_python(data, strict=True)
    finally:
        _STRICT_PASS.reset(token)


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
    400: "The body could not be parsed (not JSON, or a broken multipart form).",
    401: "Missing or wrong API key.",
    403: "The key may not do this (e.g. list another owner's jobs without admin rights).",
    404: "No such resource, or it belongs to another owner.",
    409: "Conflict with the resource's state.",
    413: "Upload over the size limit.",
    422: "Invalid input; `errors` names each field.",
    429: "Too many at once (e.g. open event streams); `Retry-After` says when to try again.",
    503: "A dependency (database, broker) is unreachable.",
}
