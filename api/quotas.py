"""Per-owner quotas: requests per minute on submit and upload, and jobs waiting in the queue.

Rates are token buckets per owner and action, per API process (``trainjobs serve --api-processes N``
allows N times the rate), checked from the headers alone, before the body is read, by
:class:`QuotaMiddleware` (which runs after the key check). The queued-jobs quota is a count in the
database at submit. Over a quota: 429 problem+json with ``Retry-After``. A limit of 0 turns it off.
"""

from __future__ import annotations

import math
import time
from typing import Any

from sqlalchemy import Connection
from starlette.types import ASGIApp, Receive, Scope, Send

from api.auth import CALLER_SCOPE_KEY
from api.problems import Problem, problem_response
from service_core.db.jobstore import queued_count
from service_core.keys import Caller

# (method, path) -> the action whose rate is limited, and the setting that sets it.
RATE_LIMITED = {
    ("POST", "/v1/jobs"): ("submit", "TRAINJOBS_SUBMITS_PER_MINUTE"),
    ("POST", "/v1/datasets"): ("upload", "TRAINJOBS_UPLOADS_PER_MINUTE"),
}
QUEUED_RETRY_AFTER_S = 60


def too_many(detail: str, retry_after_s: float) -> Problem:
    return Problem(429, detail, headers={"Retry-After": str(max(1, math.ceil(retry_after_s)))})


class RateLimiter:
    """Token buckets: ``per_minute[action]`` requests a minute per owner, in bursts of up to as many."""

    def __init__(self, per_minute: dict[str, int], max_owners: int = 100_000) -> None:
        self.per_minute, self.max_owners = per_minute, max_owners
        self._buckets: dict[tuple[str, str], tuple[float, float]] = {}  # -> (tokens, at)

    def wait_s(self, owner: str, action: str) -> float:
        """0 and one token taken, or the seconds until a token is free (nothing taken)."""
        rate = self.per_minute.get(action, 0)
        if rate <= 0:
            return 0.0
        now = time.monotonic()
        if len(self._buckets) >= self.max_owners:
            self._buckets.clear()  # many distinct owners at once is rare: start over
        tokens, at = self._buckets.get((owner, action), (float(rate), now))
        tokens = min(float(rate), tokens + (now - at) * rate / 60.0)
        if tokens < 1.0:
            self._buckets[(owner, action)] = (tokens, now)
            return (1.0 - tokens) * 60.0 / rate
        self._buckets[(owner, action)] = (tokens - 1.0, now)
        return 0.0


class QuotaMiddleware:
    """429 for an owner over its submit or upload rate, before the body is read."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        limited = (
            RATE_LIMITED.get((scope.get("method", ""), scope.get("path", ""))) if scope["type"] == "http" else None
        )
        caller: Caller | None = scope.get(CALLER_SCOPE_KEY)
        if limited is not None and caller is not None:
            limiter: RateLimiter = _state(scope).rate_limiter
            wait = limiter.wait_s(caller.owner, limited[0])
            if wait > 0:
                problem = too_many(f"too many {limited[0]}s a minute for {caller.owner} ({limited[1]})", wait)
                await problem_response(problem)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _state(scope: Scope) -> Any:
    return scope["app"].state


def check_queued_quota(conn: Connection, owner: str, limit: int) -> None:
    """429 when ``owner`` already has ``limit`` jobs waiting in the queue (0: no limit)."""
    if limit <= 0:
        return
    queued = conn.execute(queued_count(owner)).scalar_one()
    if queued >= limit:
        raise too_many(
            f"{owner} has {queued} jobs queued, the most allowed (TRAINJOBS_MAX_QUEUED_PER_OWNER); "
            "wait for some to start or cancel some",
            QUEUED_RETRY_AFTER_S,
        )
