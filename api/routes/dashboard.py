"""Pages for people: the dashboard (``/dashboard``) and the API docs (``/docs``, ``/redoc``).

Everything these pages load comes from ``api/static`` (vendored Swagger UI, ReDoc, uPlot and js-yaml
with their licences, see ``api/static/vendor/README.md``), never from a CDN: GPU clusters are often
air-gapped, and a docs page that needs the internet is blank there. The pages hold no secrets; the
dashboard calls the same public ``/v1`` routes as every other client with the key the user types.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles

router = APIRouter(tags=["dashboard"])

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
STATIC_URL = "/static"
VENDOR_URL = f"{STATIC_URL}/vendor"


def static_files() -> StaticFiles:
    """The app mounts this at ``STATIC_URL`` (dashboard modules, styles, vendored libraries)."""
    return StaticFiles(directory=STATIC_DIR)


@router.get("/dashboard", include_in_schema=False)
def dashboard() -> FileResponse:
    """The dashboard's single page; its modules route between views without reloading."""
    return FileResponse(STATIC_DIR / "dashboard.html", media_type="text/html")


@router.get("/docs", include_in_schema=False)
def swagger_ui(request: Request) -> HTMLResponse:
    """Swagger UI from package files; the Authorize button takes the Bearer key and keeps it for the tab."""
    return get_swagger_ui_html(
        openapi_url=request.app.openapi_url or "/openapi.json",
        title=f"{request.app.title} - API docs",
        swagger_js_url=f"{VENDOR_URL}/swagger-ui/swagger-ui-bundle.js",
        swagger_css_url=f"{VENDOR_URL}/swagger-ui/swagger-ui.css",
        swagger_favicon_url=f"{VENDOR_URL}/swagger-ui/favicon-32x32.png",
        swagger_ui_parameters={"persistAuthorization": False, "tryItOutEnabled": True, "displayRequestDuration": True},
    )


@router.get("/redoc", include_in_schema=False)
def redoc(request: Request) -> HTMLResponse:
    """ReDoc from package files (no Google Fonts: the system font stack instead)."""
    return get_redoc_html(
        openapi_url=request.app.openapi_url or "/openapi.json",
        title=f"{request.app.title} - API reference",
        redoc_js_url=f"{VENDOR_URL}/redoc/redoc.standalone.js",
        redoc_favicon_url=f"{VENDOR_URL}/swagger-ui/favicon-32x32.png",
        with_google_fonts=False,
    )
