"""``GET /dashboard``: one static page, no key needed to load it, every call it makes authenticated."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient


def test_dashboard_page_is_served_and_calls_the_v1_api_with_the_pasted_key(client: TestClient) -> None:
    response = client.get("/dashboard")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    page = response.text
    # Lists jobs and streams one job's events through fetch (EventSource cannot send the header).
    assert 'fetch("/v1/jobs?limit=50"' in page
    assert re.search(r'fetch\("/v1/jobs/" \+ id \+ "/events"', page)
    assert '"Bearer " + key' in page and "Last-Event-ID" in page
    assert "EventSource(" not in page


def test_dashboard_is_not_part_of_the_openapi_schema(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert "/dashboard" not in paths and "/metrics" not in paths
