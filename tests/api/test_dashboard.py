"""Pages for people: ``/dashboard``, ``/docs`` and ``/redoc`` load only files the package ships.

(The browser tests in tests/ui drive these pages in Chromium; these check what is served.)"""

from __future__ import annotations

import re
from pathlib import Path

from fastapi.testclient import TestClient

from api.routes.dashboard import STATIC_DIR


def asset_urls(html: str) -> list[str]:
    return re.findall(r"""<(?:script|link)[^>]*(?:src|href)=["']([^"']+)["']""", html)


def test_dashboard_page_loads_its_modules_and_uplot_from_the_package(client: TestClient) -> None:
    response = client.get("/dashboard")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/html")
    urls = asset_urls(response.text)
    assert "/static/js/main.js" in urls and "/static/vendor/uplot/uPlot.iife.min.js" in urls
    for url in urls:
        assert url.startswith(("/static/", "data:")), url
        if url.startswith("/static/"):
            assert client.get(url).status_code == 200, url
    module = client.get("/static/js/main.js")
    assert "javascript" in module.headers["content-type"]


def test_every_module_is_served_and_imports_only_siblings(client: TestClient) -> None:
    for path in sorted((STATIC_DIR / "js").glob("*.js")):
        source = path.read_text()
        for target in re.findall(r"""from\s+["']([^"']+)["']""", source):
            assert target.startswith("./") and (path.parent / target).is_file(), (path.name, target)
        # No URL but the SVG namespace (an identifier, never fetched).
        assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", source), path.name
        assert client.get(f"/static/js/{path.name}").status_code == 200


def test_the_key_travels_in_the_authorization_header_only() -> None:
    api = (STATIC_DIR / "js" / "api.js").read_text()
    assert 'Authorization: "Bearer " + currentKey()' in api
    assert "sessionStorage.setItem" in api and "localStorage.removeItem" in api
    for path in (STATIC_DIR / "js").glob("*.js"):
        # No module builds a URL from the key (query strings end up in logs and history).
        assert not re.search(r"[?&](key|api_key|token)=", path.read_text()), path.name


def test_docs_and_redoc_are_served_from_package_files(client: TestClient) -> None:
    for page, expected in (("/docs", "swagger-ui-bundle.js"), ("/redoc", "redoc.standalone.js")):
        html = client.get(page).text
        urls = asset_urls(html)
        assert any(url.endswith(expected) for url in urls), urls
        for url in urls:
            assert url.startswith("/static/vendor/"), url
            assert client.get(url).status_code == 200, url
        assert "cdn." not in html and "fonts.googleapis" not in html
    assert "/openapi.json" in client.get("/docs").text


def test_vendored_libraries_keep_their_licences_and_call_no_cdn() -> None:
    vendor = STATIC_DIR / "vendor"
    for folder in ("swagger-ui", "redoc", "uplot", "js-yaml"):
        assert (vendor / folder / "LICENSE").is_file(), folder
    assert "cdn.redoc.ly" not in (vendor / "redoc" / "redoc.standalone.js").read_text()
    assert "swagger-ui-dist | 5.35.0" in (vendor / "README.md").read_text()


def test_static_files_do_not_escape_their_folder(client: TestClient) -> None:
    assert client.get("/static/../main.py").status_code == 404
    assert client.get("/static/%2e%2e/main.py").status_code == 404
    assert client.get("/static/nope.js").status_code == 404


def test_pages_are_not_part_of_the_openapi_schema(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    for page in ("/dashboard", "/docs", "/redoc", "/metrics"):
        assert page not in paths


def test_package_data_ships_the_static_folders() -> None:
    pyproject = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert '"static/js/*"' in pyproject and '"static/vendor/*/*"' in pyproject
