"""``/healthz`` (the process answers) and ``/readyz`` (the database and the broker answer)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from kombu import Connection

from api.deps import SessionDep, SettingsDep
from api.problems import Problem
from api.schemas.common import problem_responses
from service_core.db.session import ping

router = APIRouter(tags=["health"])

BROKER_TIMEOUT_S = 2.0


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


def broker_reachable(url: str) -> None:
    """Connect once, briefly; raises when the broker is down."""
    with Connection(url, connect_timeout=BROKER_TIMEOUT_S, transport_options={"max_retries": 1}) as conn:
        conn.ensure_connection(max_retries=1, interval_start=0, timeout=BROKER_TIMEOUT_S)


@router.get("/readyz", responses=problem_responses(503))
def readyz(request: Request, session: SessionDep, settings: SettingsDep) -> dict[str, Any]:
    checks: dict[str, str] = {}
    try:
        ping(session)
        checks["database"] = "ok"
    except Exception as exc:  # any driver error means "not ready", reported below
        checks["database"] = f"error: {type(exc).__name__}"
    try:
        broker_reachable(settings.broker_url)
        checks["broker"] = "ok"
    except Exception as exc:
        checks["broker"] = f"error: {type(exc).__name__}"
    if any(v != "ok" for v in checks.values()):
        raise Problem(503, "not ready: " + ", ".join(f"{k} {v}" for k, v in checks.items()), checks=checks)
    # Ready either way; `warmed_up` says whether this process has loaded the estimator and Celery,
    # so the first submit it serves answers at full speed (a load test waits for it).
    return {"status": "ok", "checks": checks, "warmed_up": request.app.state.warmed_up.is_set()}
