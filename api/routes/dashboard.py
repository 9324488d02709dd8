"""``GET /dashboard``: a single static page that lists jobs and follows one live over SSE.

The page holds no secrets: the user pastes an API key, kept in the browser's localStorage, and the
page calls the same ``/v1`` routes as every other client.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

router = APIRouter(tags=["dashboard"])

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"


@router.get("/dashboard", include_in_schema=False)
def dashboard() -> FileResponse:
    """The dashboard page (static HTML + JS)."""
    return FileResponse(STATIC_DIR / "dashboard.html", media_type="text/html")
