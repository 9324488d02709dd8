"""Errors as data: every error the API returns is ``application/problem+json`` (RFC 9457).

Validation errors are ``422`` with an ``errors`` list of ``{field, message, type}``, where ``field`` is
the dotted path a user would fix (``efficiency.local_sgd_steps``), the same paths the CLI shows. The
catch-all turns anything unexpected into a 500 problem without internals; bad input never gets there.
A database that cannot be reached (down, restarting, a network cut, a full pool) is a 503 with
``Retry-After`` on every route, not a 500: nothing is wrong with the request, and the API recovers by
itself once the database is back (the pool's pre-ping drops dead connections).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match
from starlette.types import Scope

from service_core.db.session import DATABASE_UNAVAILABLE
from trainer_core.spec import FieldError, SpecError, field_errors

logger = logging.getLogger(__name__)

PROBLEM_MEDIA_TYPE = "application/problem+json"
DATABASE_RETRY_AFTER_S = 5

# Where FastAPI puts a parameter; not part of the field path a user would type.
# The methods a route of this API may serve (HEAD and OPTIONS are never routes of their own here).
_METHODS = ("DELETE", "GET", "PATCH", "POST", "PUT")
_REQUEST_PARTS = {"body", "query", "path", "header", "cookie"}


class Problem(Exception):
    """Raise from a route or helper to answer with a problem document.

    ``extra`` members (``estimate``, ``plan``, ``checks``...) are added to the body as RFC 9457
    extension members.
    """

    def __init__(
        self,
        status: int,
        detail: str | None = None,
        *,
        title: str | None = None,
        type_: str = "about:blank",
        headers: Mapping[str, str] | None = None,
        **extra: Any,
    ):
        self.status = status
        self.title = title or HTTPStatus(status).phrase
        self.detail = detail
        self.type = type_
        self.headers = dict(headers or {})
        self.extra = extra
        super().__init__(detail or self.title)


def problem_response(problem: Problem) -> JSONResponse:
    body: dict[str, Any] = {"type": problem.type, "title": problem.title, "status": problem.status}
    if problem.detail is not None:
        body["detail"] = problem.detail
    body.update(problem.extra)
    return JSONResponse(body, status_code=problem.status, headers=problem.headers, media_type=PROBLEM_MEDIA_TYPE)


def validation_problem(errors: Sequence[FieldError], *, title: str = "Invalid request", **extra: Any) -> Problem:
    """A 422 naming each wrong field; ``detail`` repeats them in one readable line."""
    return Problem(
        422,
        "; ".join(f"{e.field}: {e.message}" for e in errors),
        title=title,
        type_="urn:trainjobs:problem:validation",
        errors=[{"field": e.field, "message": e.message, "type": e.type} for e in errors],
        **extra,
    )


def request_field_errors(exc: RequestValidationError) -> list[FieldError]:
    """FastAPI's errors with the ``body``/``query`` prefix dropped and cross-field paths resolved."""
    errors = []
    for err in exc.errors():
        loc = tuple(err.get("loc", ()))
        if loc and loc[0] in _REQUEST_PARTS and not (loc[0] != "body" and len(loc) == 1):
            loc = loc[1:]
        errors.append({**err, "loc": loc})
    return field_errors(errors)


async def _on_problem(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, Problem)
    return problem_response(exc)


async def _on_spec_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, SpecError)
    return problem_response(validation_problem(exc.errors, title="Invalid job spec"))


async def _on_request_validation(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return problem_response(validation_problem(request_field_errors(exc)))


async def _on_http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    detail = exc.detail if isinstance(exc.detail, str) else None
    headers = dict(exc.headers or {})
    if exc.status_code == 405:
        # Starlette's Allow names only the first route that matched the path; a path served by
        # several routes (GET and POST /v1/jobs) must list them all (RFC 9110 15.5.6).
        headers["Allow"] = ", ".join(allowed_methods(request.app, request.scope))
    return problem_response(Problem(exc.status_code, detail, headers=headers))


def allowed_methods(app: FastAPI, scope: Scope) -> list[str]:
    """Every method some route serves at the request's path: those a route fully matches.

    Asked of the router itself, method by method: FastAPI nests included routers, so the routes of a
    path are not a flat list to read methods from.
    """
    return [
        method
        for method in _METHODS
        if any(route.matches({**scope, "method": method})[0] == Match.FULL for route in app.router.routes)
    ]


def database_unavailable(method: str, path: str, exc: BaseException) -> Problem:
    """The 503 for a database that cannot be reached (from a route, or a middleware before one)."""
    logger.warning("database unavailable on %s %s: %s", method, path, type(exc).__name__)
    retry = {"Retry-After": str(DATABASE_RETRY_AFTER_S)}
    return Problem(503, "the database is unavailable; retry shortly", headers=retry)


async def _on_database_unavailable(request: Request, exc: Exception) -> JSONResponse:
    return problem_response(database_unavailable(request.method, request.url.path, exc))


async def _on_unexpected(request: Request, exc: Exception) -> JSONResponse:
    # Log the traceback for operators; the client gets no internals.
    logger.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return problem_response(Problem(500, "an unexpected error occurred; it has been logged"))


def install_problem_handlers(app: FastAPI) -> None:
    """Route every error type the app can raise to a problem+json response."""
    app.add_exception_handler(Problem, _on_problem)
    app.add_exception_handler(SpecError, _on_spec_error)
    app.add_exception_handler(RequestValidationError, _on_request_validation)
    app.add_exception_handler(StarletteHTTPException, _on_http_exception)
    for error in DATABASE_UNAVAILABLE:
        app.add_exception_handler(error, _on_database_unavailable)
    app.add_exception_handler(Exception, _on_unexpected)
