"""The usual request to a hot endpoint (submit, estimate), served without FastAPI's per-request
machinery; FastAPI's own route serves every other request to it, and documents it.

Why (issue 25): profiled in-process, an estimate spent more of its CPU in FastAPI than in the
estimate. Its three dependencies only read ``app.state`` and the caller the auth gate found, yet
solving them took five ``solve_dependencies`` calls and a cache key each; the body was parsed twice
(``json.loads``, then pydantic over the Python objects); and the answer was validated again against
its response model. A submit pays the same, with three more dependencies and a header.

A :class:`FastPath` is a route placed ahead of the FastAPI route of the same method and path. For the
request it knows (a JSON body, a caller found by ``AuthGateMiddleware``, no query string, no
dependency override, and what its ``accepts`` asks of the headers) it validates the body straight
from its bytes (``model_validate_json``: the same model, so the same validators and the same strict
JSON types), calls the endpoint function with what the dependencies would have given it, and
serializes the answer as FastAPI does (the response model, by alias, to JSON bytes). For any other
request, and for a body that does not validate, it declines: the request goes on to the FastAPI route
with the body already read, so every error is answered exactly as before, by the same code.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, TypeAdapter, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Match, NoMatchFound
from starlette.types import Message, Receive, Scope, Send

from api.auth import CALLER_SCOPE_KEY
from service_core.keys import Caller

# Set in the scope of a request a fast path passed on, so that routing it again skips the fast path.
DECLINED_SCOPE_KEY = "trainjobs.fast_path_declined"

# serve(request, body, caller, response): the endpoint's answer. ``response`` is FastAPI's
# ``Response`` parameter: headers (and a status) the endpoint sets on it are sent with the answer.
Serve = Callable[[Request, Any, Caller, Response], Awaitable[Any]]


def is_json(content_type: str | None) -> bool:
    """Whether FastAPI parses a body of this Content-Type as JSON (``application/json`` or ``+json``)."""
    if not content_type:
        return False
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


class FastPath(BaseRoute):
    """Serves ``method path`` when the request is the usual one (see the module docstring)."""

    def __init__(
        self,
        method: str,
        path: str,
        body_model: type[BaseModel],
        response_model: type[BaseModel],
        serve: Serve,
        *,
        status_code: int = 200,
        accepts: Callable[[Request], bool] = lambda _request: True,
    ):
        self.method, self.path, self.body_model, self.serve = method, path, body_model, serve
        self.status_code, self.accepts = status_code, accepts
        self.answer = TypeAdapter(response_model)

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if (
            scope["type"] == "http"
            and scope["method"] == self.method
            and scope["path"] == self.path
            and DECLINED_SCOPE_KEY not in scope
        ):
            # "route": as FastAPI's routes set it; the request metrics label by its path
            return Match.FULL, {"route": self}
        return Match.NONE, {}

    def url_path_for(self, name: str, /, **path_params: Any) -> Any:
        raise NoMatchFound(name, path_params)  # named routes are FastAPI's; this one only serves

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        try:
            raw = await request.body()
        except HTTPException:  # a body over its limit (api/uploads.py): answered 413 as on FastAPI's route
            raise
        except Exception as exc:  # as FastAPI answers a body it could not read (a client gone mid-body)
            raise HTTPException(400, "There was an error parsing the body") from exc
        body = self.usual_body(request, raw)
        if body is None:
            await self.decline(scope, raw, receive, send)
            return
        # FastAPI's Response parameter: no body, no status until the endpoint sets one
        sub = Response()
        del sub.headers["content-length"]
        sub.status_code = None  # type: ignore[assignment]
        value = await self.serve(request, body, scope[CALLER_SCOPE_KEY], sub)
        if isinstance(value, Response):
            response = value
        else:
            content = self.answer.dump_json(self.answer.validate_python(value), by_alias=True)
            response = Response(content, status_code=sub.status_code or self.status_code,
                                media_type="application/json")  # fmt: skip
            response.headers.raw.extend(sub.headers.raw)
        await response(scope, receive, send)

    def usual_body(self, request: Request, raw: bytes) -> BaseModel | None:
        """The validated body when this path serves the request; None when FastAPI's route should."""
        scope = request.scope
        if (
            not raw
            or scope["query_string"]
            or scope.get(CALLER_SCOPE_KEY) is None
            or not is_json(request.headers.get("content-type"))
            or request.app.dependency_overrides
            or not self.accepts(request)
        ):
            return None
        try:
            return self.body_model.model_validate_json(raw)
        except ValidationError:  # FastAPI's route names the fields, as it always has
            return None

    async def decline(self, scope: Scope, raw: bytes, receive: Receive, send: Send) -> None:
        """Route the request again, past this path, with its body given back to whoever reads it."""
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()  # the disconnect, when the client goes
            replayed = True
            return {"type": "http.request", "body": raw, "more_body": False}

        await scope["router"]({**scope, DECLINED_SCOPE_KEY: True}, replay, send)


def install_fast_paths(app: FastAPI, paths: list[FastPath]) -> None:
    """Put ``paths`` ahead of every other route of ``app`` (each matches one method and path only)."""
    app.router.routes[:0] = paths
