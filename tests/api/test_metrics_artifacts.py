"""Metric points by polling (paged by seq) and artifact list/download (on a local and an object-store
root), each with its trio."""

from __future__ import annotations

import io
import zipfile
from typing import Any

import fsspec
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from api.main import create_app
from service_core.db.models import MetricPoint
from service_core.db.session import allocate_seqs
from service_core.settings import Settings
from tests.api.conftest import Keys, add_job

pytestmark = pytest.mark.both_databases


def add_points(session: Session, job_id: str, steps: int) -> None:
    """Like the worker: each logging step takes one seq and stores one point per metric name."""
    for step in range(1, steps + 1):
        seq = allocate_seqs(session, job_id, 1)
        for name, value in (("learning_rate", 1e-3), ("loss", 1.0 / step)):
            session.add(MetricPoint(job_id=job_id, seq=seq, step=step, epoch=step / steps, name=name, value=value))
    session.commit()


def get_page(client: TestClient, job_id: str, key: str, **params: Any) -> dict[str, Any]:
    response = client.get(f"/v1/jobs/{job_id}/metrics", params=params, headers=Keys.auth(key))
    assert response.status_code == 200, response.text
    body: dict[str, Any] = response.json()
    return body


def test_metrics_page_by_seq_without_splitting_a_seq(client: TestClient, keys: Keys, session: Session) -> None:
    job = add_job(session, "alice")
    add_points(session, job.id, steps=5)
    collected: list[dict[str, Any]] = []
    after = 0
    while True:
        page = get_page(client, job.id, keys.alice, after=after, limit=3)
        collected += page["items"]
        assert page["next_after"] >= after
        after = page["next_after"]
        if not page["has_more"]:
            break
        # a page of 3 points never ends halfway through a seq's two points
        assert len(page["items"]) == 2
    assert [(p["seq"], p["name"]) for p in collected] == [
        (seq, name) for seq in range(1, 6) for name in ("learning_rate", "loss")
    ]
    assert collected[1] | {"time": None} == {
        "seq": 1,
        "step": 1,
        "epoch": 0.2,
        "name": "loss",
        "value": 1.0,
        "time": None,
    }
    assert get_page(client, job.id, keys.alice, after=after) == {"items": [], "next_after": after, "has_more": False}


def test_metrics_filter_by_name(client: TestClient, keys: Keys, session: Session) -> None:
    job = add_job(session, "alice")
    add_points(session, job.id, steps=4)
    page = get_page(client, job.id, keys.alice, name="loss", after=1)
    assert [(p["seq"], p["value"]) for p in page["items"]] == [(2, 0.5), (3, 1 / 3), (4, 0.25)]
    assert page["next_after"] == 4


def test_one_seq_larger_than_the_limit_is_returned_whole(client: TestClient, keys: Keys, session: Session) -> None:
    job = add_job(session, "alice")
    add_points(session, job.id, steps=2)
    page = get_page(client, job.id, keys.alice, limit=1)
    assert [(p["seq"], p["name"]) for p in page["items"]] == [(1, "learning_rate"), (1, "loss")]
    assert page["has_more"] is True and page["next_after"] == 1


def test_metrics_not_found_not_yours(client: TestClient, keys: Keys, session: Session) -> None:
    job = add_job(session, "alice")
    assert client.get("/v1/jobs/nope/metrics", headers=keys.auth(keys.alice)).status_code == 404
    assert client.get(f"/v1/jobs/{job.id}/metrics", headers=keys.auth(keys.bob)).status_code == 404
    assert client.get(f"/v1/jobs/{job.id}/metrics").status_code == 401
    bad = client.get(f"/v1/jobs/{job.id}/metrics", params={"limit": 0}, headers=keys.auth(keys.alice))
    assert bad.status_code == 422 and bad.json()["errors"][0]["field"] == "limit"


def write_artifacts(app: FastAPI, job_id: str) -> dict[str, bytes]:
    files = {"model/config.json": b'{"model_type": "bert"}', "metrics.json": b'{"eval_accuracy": 1.0}'}
    store = app.state.artifacts
    for path, content in files.items():
        full = f"{store.job_dir(job_id)}/{path}"
        store.fs.makedirs(full.rsplit("/", 1)[0], exist_ok=True)
        with store.fs.open(full, "wb") as handle:
            handle.write(content)
    return files


def test_artifacts_list_and_download(app: FastAPI, client: TestClient, keys: Keys, session: Session) -> None:
    job = add_job(session, "alice")
    assert client.get(f"/v1/jobs/{job.id}/artifacts", headers=keys.auth(keys.alice)).json() == {"items": []}
    files = write_artifacts(app, job.id)
    listing = client.get(f"/v1/jobs/{job.id}/artifacts", headers=keys.auth(keys.alice)).json()["items"]
    assert listing == [{"path": p, "size": len(c)} for p, c in sorted(files.items())]
    download = client.get(f"/v1/jobs/{job.id}/artifacts/model/config.json", headers=keys.auth(keys.alice))
    assert download.status_code == 200
    assert download.content == files["model/config.json"]
    assert download.headers["content-type"] == "application/json"
    assert 'filename="config.json"' in download.headers["content-disposition"]


def test_artifacts_not_found_not_yours_and_escapes(
    app: FastAPI, client: TestClient, keys: Keys, session: Session
) -> None:
    job = add_job(session, "alice")
    other = add_job(session, "alice")
    write_artifacts(app, job.id)
    write_artifacts(app, other.id)
    url = f"/v1/jobs/{job.id}/artifacts"
    assert client.get(f"{url}/missing.bin", headers=keys.auth(keys.alice)).status_code == 404
    assert client.get("/v1/jobs/nope/artifacts", headers=keys.auth(keys.alice)).status_code == 404
    assert client.get(url, headers=keys.auth(keys.bob)).status_code == 404
    assert client.get(f"{url}/metrics.json", headers=keys.auth(keys.bob)).status_code == 404
    assert client.get(f"{url}/metrics.json").status_code == 401
    # an encoded climb into a sibling job's folder is refused, not served
    escape = client.get(f"{url}/%2E%2E/{other.id}/metrics.json", headers=keys.auth(keys.alice))
    assert escape.status_code == 422, escape.text
    assert escape.headers["content-type"] == "application/problem+json"


def test_artifacts_are_listed_downloaded_and_zipped_from_the_object_store(
    settings: Settings, keys: Keys, session: Session, s3_root: str
) -> None:
    # The API on an s3:// root (a real SeaweedFS); the files are written by another machine's client.
    app = create_app(settings.model_copy(update={"artifacts_root_": s3_root}))
    job = add_job(session, "alice")
    url = f"/v1/jobs/{job.id}/artifacts"
    files = {"model/config.json": b'{"model_type": "bert"}', "checkpoints/4/manifest.json": b'{"step": 4}'}
    with TestClient(app) as client:
        assert client.get(url, headers=keys.auth(keys.alice)).json() == {"items": []}  # listed before any write
        writer = fsspec.filesystem("s3", skip_instance_cache=True)
        for path, content in files.items():
            writer.pipe_file(f"{s3_root.removeprefix('s3://')}/{job.id}/{path}", content)
        listing = client.get(url, headers=keys.auth(keys.alice)).json()["items"]
        assert listing == [{"path": p, "size": len(c)} for p, c in sorted(files.items())]  # not a stale listing
        download = client.get(f"{url}/model/config.json", headers=keys.auth(keys.alice))
        assert (download.status_code, download.content) == (200, files["model/config.json"])
        archive = client.get(f"{url}.zip", headers=keys.auth(keys.alice))
        assert archive.status_code == 200, archive.text
        with zipfile.ZipFile(io.BytesIO(archive.content)) as zipped:
            assert {name: zipped.read(name) for name in zipped.namelist()} == files
        assert client.get(url, headers=keys.auth(keys.bob)).status_code == 404
