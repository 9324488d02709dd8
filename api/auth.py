"""The API's side of keys: a gate that authenticates ``/v1/`` requests from their headers before
their body is read, and a per-process cache of keys it has checked (the keys themselves live in
:mod:`service_core.keys`)."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import Engine
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Receive, Scope, Send

from api.problems import Problem, database_unavailable, problem_response
from service_core.db.session import DATABASE_UNAVAILABLE
from service_core.keys import Caller, authenticate_hash, hash_key, touch_api_key


class KeyCache:
    """Callers of keys this process accepted in the last ``ttl`` seconds, by key hash.

    Without it every request spends a database round trip (and a thread hand-off) on a lookup
    whose answer almost never changes; that was a seventh of a submit's CPU. The price is that a
    revoked key keeps working for up to ``ttl`` seconds in a process that saw it just before
    (``TRAINJOBS_AUTH_CACHE_SECONDS``; 0 asks the database every time). Unknown keys are never
    cached, so a new key works at once. Used from the event loop thread only: no lock.
    """

    def __init__(self, ttl: float, max_entries: int = 10_000) -> None:
        self.ttl = ttl
        self.max_entries = max_entries
        self._entries: dict[str, tuple[float, Caller]] = {}

    def get(self, key_hash: str) -> Caller | None:
        entry = self._entries.get(key_hash)
        if entry is None:
            return None
        if entry[0] <= time.monotonic():
            del self._entries[key_hash]
            return None
        return entry[1]

    def put(self, key_hash: str, caller: Caller) -> None:
        if self.ttl <= 0:
            return
        if len(self._entries) >= self.max_entries:
            # Many distinct keys at once is rare: start over rather than track ages.
            self._entries.clear()
        self._entries[key_hash] = (time.monotonic() + self.ttl, caller)


# Where the gate leaves the caller it authenticated, for `api.deps.get_caller`.
CALLER_SCOPE_KEY = "trainjobs.caller"
_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="trainjobs"'}


def bearer_key(scope: Scope) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header, or None."""
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, key = value.decode("latin-1").partition(" ")
            return (key.strip() or None) if scheme.lower() == "bearer" else None
    return None


async def authenticate(app: Any, key: str | None) -> Caller:
    """The caller of ``key`` (cached for ``ttl`` seconds); a 401 Problem when missing or unknown."""
    if key is None:
        raise Problem(401, "send `Authorization: Bearer <api key>`", headers=_CHALLENGE)
    key_hash = hash_key(key, app.state.settings.secret_key)
    cache: KeyCache = app.state.key_cache
    caller = cache.get(key_hash)
    if caller is None:
        caller = await run_in_threadpool(lookup_caller, app.state.engine, key_hash)
        if caller is None:
            raise Problem(401, "the API key is unknown or revoked", headers=_CHALLENGE)
        cache.put(key_hash, caller)
    return caller


def lookup_caller(engine: Engine, key_hash: str) -> Caller | None:
    """Autocommit statements on a pooled connection: no session, no BEGIN/ROLLBACK round trips.

    Only a cache miss gets here, so ``last_used_at`` is recorded at most once per cache period
    (and at most once a minute) per key and API process, not on every request.
    """
    with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        caller = authenticate_hash(conn, key_hash)
        if caller is not None:
            touch_api_key(conn, caller.key_id)
        return caller


class AuthGateMiddleware:
    """Authenticate every ``/v1/`` request from its headers before any of its body is read.

    FastAPI reads and parses a body before it runs dependencies, so a key check as a dependency
    comes after a client without a key has sent (and the API has buffered) all of it. Here a
    request without a valid key is answered 401 having read nothing; the caller found is left in
    the scope for the ``CallerDep`` dependency, which then costs nothing.
    """

    def __init__(self, app: ASGIApp, *, prefix: str = "/v1/"):
        self.app, self.prefix = app, prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.prefix):
            try:
                scope[CALLER_SCOPE_KEY] = await authenticate(scope["app"], bearer_key(scope))
            except Problem as problem:
                await problem_response(problem)(scope, receive, send)
                return
            except DATABASE_UNAVAILABLE as exc:  # outside the app's exception handlers: answer it here
                await problem_response(database_unavailable(scope["method"], scope["path"], exc))(scope, receive, send)
                return
        await self.app(scope, receive, send)
