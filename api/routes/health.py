"""``/healthz`` (the process answers) and ``/readyz`` (the database and the broker answer)."""

from __future__ import annotations

from typing import Any

import anyio.to_thread
from fastapi import APIRouter, Request
from kombu import Connection
from sqlalchemy.orm import Session, sessionmaker

from api.deps import SettingsDep
from api.problems import Problem
from api.schemas.common import problem_responses
from service_core.db.session import ping
from service_core.settings import Settings

router = APIRouter(tags=["health"])

BROKER_TIMEOUT_S = 2.0


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    # On the event loop: no thread, no connection, so it answers whatever the other routes hold.
    return {"status": "ok"}


def broker_reachable(url: str) -> None:
    """Connect once, briefly; raises when the broker is down."""
    with Connection(url, connect_timeout=BROKER_TIMEOUT_S, transport_options={"max_retries": 1}) as conn:
        conn.ensure_connection(max_retries=1, interval_start=0, timeout=BROKER_TIMEOUT_S)


@router.get("/readyz", responses=problem_responses(503))
async def readyz(request: Request, settings: SettingsDep) -> dict[str, Any]:
    # On a thread and a connection of its own (api.main.READY_THREADS): busy routes cannot starve it.
    checks = await anyio.to_thread.run_sync(
        run_checks, request.app.state.sessionmaker, settings, limiter=request.app.state.ready_limiter
    )
    if any(v != "ok" for v in checks.values()):
        raise Problem(503, "not ready: " + ", ".join(f"{k} {v}" for k, v in checks.items()), checks=checks)
    # Ready either way; `warmed_up` says whether this process has loaded the estimator and Celery,
    # so the first submit it serves answers at full speed (a load test waits for it).
    return {"status": "ok", "checks": checks, "warmed_up": request.app.state.warmed_up.is_set()}


def run_checks(sessions: sessionmaker[Session], settings: Settings) -> dict[str, str]:
    """ "ok" or the error's type for the database and the broker (blocking)."""
    checks: dict[str, str] = {}
    try:
        with sessions() as session:
            ping(session)
        checks["database"] = "ok"
    except Exception as exc:  # any driver error means "not ready", reported below
        checks["database"] = f"error: {type(exc).__name__}"
    try:
        broker_reachable(settings.broker_url)
        checks["broker"] = "ok"
    except Exception as exc:
        checks["broker"] = f"error: {type(exc).__name__}"
    return checks
