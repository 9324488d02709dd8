"""The OpenAPI document, with what FastAPI leaves out of it.

FastAPI answers a body it cannot parse (bytes that are not JSON, a broken multipart form) with a
400 before any route runs, so no route can declare it: it is added here to every operation that
takes a body, the one place where it can happen.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from api.schemas.common import problem_responses

_UNPARSEABLE = 400


def install_openapi(app: FastAPI) -> None:
    """Make ``app.openapi()`` build (once) the document with the 400s of body-taking operations."""

    build = app.openapi  # FastAPI's own: builds the document once and keeps it in app.openapi_schema

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            add_unparseable_body_responses(build())
        return build()

    app.openapi = openapi  # type: ignore[method-assign]


def add_unparseable_body_responses(document: dict[str, Any]) -> None:
    """Document the 400 on every operation with a request body (as problem+json, like every error)."""
    entry = problem_responses(_UNPARSEABLE)[_UNPARSEABLE]
    problem_ref = {"$ref": "#/components/schemas/ProblemDetails"}
    for operations in document.get("paths", {}).values():
        for operation in operations.values():
            if isinstance(operation, dict) and "requestBody" in operation:
                operation.setdefault("responses", {}).setdefault(
                    str(_UNPARSEABLE),
                    {
                        "description": entry["description"],
                        "content": {"application/problem+json": {"schema": problem_ref}},
                    },
                )
