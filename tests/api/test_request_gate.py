"""Keys are checked before a body is read, and bodies are cut off at their limit while they stream."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy.orm import Session

from service_core.settings import Settings
from tests.api.conftest import Keys, make_spec
from tests.api.live import post_chunked, serve
from tests.api.test_datasets import count_datasets

BIG = 64 << 20
# What kernel socket buffers and the server's read-ahead may take in before the server answers:
# far below the 64 MiB the client offers, far above the 1 MiB limits.
READ_AHEAD = 16 << 20
MULTIPART = (
    b'--xx\r\nContent-Disposition: form-data; name="file"; filename="big.csv"\r\n'
    b"Content-Type: text/csv\r\n\r\ntext,label\n"
)


@pytest.fixture
def live_url(app: FastAPI) -> Iterator[str]:
    with serve(app) as url:
        yield url


def test_no_key_is_401_before_the_body_is_read(live_url: str) -> None:
    for path, headers in (
        ("/v1/jobs", {"Content-Type": "application/json"}),
        ("/v1/datasets", {"Content-Type": "multipart/form-data; boundary=xx"}),
        ("/v1/jobs", {"Content-Type": "application/json", "Authorization": "Bearer not-a-key"}),
    ):
        answer = post_chunked(live_url, path, headers, b"{", BIG)
        assert answer.status == 401, answer.head
        assert "application/problem+json" in answer.head
        assert answer.sent < READ_AHEAD


def test_chunked_upload_over_the_limit_is_413_while_streaming(
    live_url: str, keys: Keys, settings: Settings, session: Session
) -> None:
    headers = {"Content-Type": "multipart/form-data; boundary=xx", **keys.auth(keys.alice)}
    answer = post_chunked(live_url, "/v1/datasets", headers, MULTIPART, BIG)
    assert answer.status == 413, answer.head
    assert "TRAINJOBS_MAX_UPLOAD_MB" in json.loads(answer.body)["detail"]
    assert answer.sent < READ_AHEAD
    assert count_datasets(session) == 0
    assert not (settings.data_root / "uploads" / "alice").exists() or not any(
        (settings.data_root / "uploads" / "alice").iterdir()
    )


def test_json_bodies_have_their_own_small_limit(live_url: str, keys: Keys) -> None:
    spec = make_spec()
    spec["model"]["config"]["padding"] = "x" * (2 << 20)  # a 2 MiB spec: over the 1 MiB default
    response = httpx.post(f"{live_url}/v1/jobs", json=spec, headers=keys.auth(keys.alice), timeout=30)
    assert response.status_code == 413
    assert response.headers["content-type"] == "application/problem+json"
    assert "TRAINJOBS_MAX_JSON_KB" in response.json()["detail"]
    headers = {"Content-Type": "application/json", **keys.auth(keys.alice)}
    chunked = post_chunked(live_url, "/v1/jobs", headers, json.dumps(spec).encode()[: 1 << 20], 4 << 20)
    assert chunked.status == 413, chunked.head
    # Small bodies still work.
    ok = httpx.post(f"{live_url}/v1/jobs", json=make_spec(), headers=keys.auth(keys.alice), timeout=30)
    assert ok.status_code == 201, ok.text
