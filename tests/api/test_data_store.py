"""An object-store data root (``DATA_ROOT=s3://...`` on a real SeaweedFS): uploads land in the store under
the owner's prefix, preflight reads data there, and a model folder there resolves through this host's cache.
(Patterns and owner isolation on both roots: test_path_patterns.py.)"""

from __future__ import annotations

import hashlib
import io
import json
import shutil
import zipfile
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from s3fs import S3FileSystem
from sqlalchemy import func, select
from sqlalchemy.orm import Session
from transformers import AutoModelForSequenceClassification

from api.schemas.examples import EXAMPLE_JOB_CREATE
from service_core.datastore import CACHE_DIR, DataStore
from service_core.db.models import Dataset, Job
from service_core.settings import Settings
from tests.api.conftest import Keys, make_spec
from tests.api.stores import put, read, settings_on_both_roots  # noqa: F401 (the fixture, on the s3 root below)
from tests.trainer_core.datagen import TINY_BERT, TINY_VIT, write_image_folder
from trainer_core.modeling import config_from_dict
from trainjobs.launcher import write_example
from trainjobs.seaweedfs import free_port

pytestmark = pytest.mark.parametrize("settings", ["s3"], indirect=True)

CSV = b"text,label\ngreat film,1\nawful film,0\nfine film,1\n"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, minilm_path: Path) -> Path:
    """A saved model folder small enough to copy per test: a tiny BERT with MiniLM's tokenizer files."""
    folder = tmp_path_factory.mktemp("tiny-model")
    AutoModelForSequenceClassification.from_config(config_from_dict(TINY_BERT)).save_pretrained(folder)
    for name in ("vocab.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(minilm_path / name, folder / name)
    return folder


def upload(client: TestClient, key: str, filename: str, content: bytes) -> Any:
    response = client.post("/v1/datasets", files={"file": (filename, content)}, headers=Keys.auth(key))
    assert response.status_code == 201, response.text
    return response.json()


def dry_run(client: TestClient, keys: Keys, spec: dict[str, Any]) -> Any:
    return client.post("/v1/jobs", params={"dry_run": "true"}, json=spec, headers=keys.auth(keys.alice))


def refused_fields(response: Any) -> list[str]:
    assert response.status_code == 422, response.text
    return [e["field"] for e in response.json()["errors"]]


def test_an_upload_lands_in_the_store_under_the_owners_prefix(
    client: TestClient, keys: Keys, settings: Settings, session: Session
) -> None:
    body = upload(client, keys.alice, "reviews.csv", CSV)
    assert body["content_hash"] == hashlib.sha256(CSV).hexdigest() and body["size_bytes"] == len(CSV)
    row = session.get(Dataset, body["id"])
    assert row is not None and row.storage_path == f"uploads/alice/{body['id']}/reviews.csv"
    assert read(settings, row.storage_path) == CSV
    # Staged locally only while it was checked: nothing stays on this host.
    assert list((settings.home / "tmp").iterdir()) == []
    assert not (settings.home / "data").exists()


def test_a_zipped_folder_upload_lands_in_the_store(
    client: TestClient, keys: Keys, settings: Settings, session: Session
) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        zf.writestr("pets/cat/1.png", b"cat")
        zf.writestr("pets/dog/1.png", b"dog")
    body = upload(client, keys.alice, "pets.zip", buffer.getvalue())
    row = session.get(Dataset, body["id"])
    assert row is not None and body["format"] == "imagefolder"
    store = DataStore.of(settings)
    folder = f"{store.base}/{row.storage_path}"
    assert sorted(path.removeprefix(folder + "/") for path in store.fs.find(folder)) == [
        "pets/cat/1.png",
        "pets/dog/1.png",
    ]


def test_a_job_on_an_upload_is_preflighted_from_the_store(
    client: TestClient, keys: Keys, settings: Settings, session: Session
) -> None:
    body = upload(client, keys.alice, "reviews.csv", CSV)
    spec = make_spec(dataset={"id": body["id"], "text_column": "text"})
    report = dry_run(client, keys, spec)
    assert report.status_code == 200, report.text
    assert report.json()["preflight"]["splits"]["train"] == {"rows": 3, "exact": True}
    created = client.post("/v1/jobs", json=spec, headers=keys.auth(keys.alice))
    assert created.status_code == 201, created.text
    location = f"{settings.data_root_url}/uploads/alice/{body['id']}/reviews.csv"
    assert created.json()["spec"]["dataset"]["data_files"] == {"train": location}
    # Bob may not use it, by id or by its URL.
    assert refused_fields(client.post("/v1/jobs", json=spec, headers=keys.auth(keys.bob))) == ["dataset.id"]
    by_url = make_spec(dataset={"path": "csv", "data_files": location})
    assert refused_fields(client.post("/v1/jobs", json=by_url, headers=keys.auth(keys.bob))) == ["dataset.data_files"]


def test_preflight_reads_the_data_on_the_store(
    client: TestClient, keys: Keys, settings: Settings, session: Session, tmp_path: Path
) -> None:
    missing = make_spec(dataset={"path": "csv", "data_files": {"train": "reviews/nope.csv"}})
    assert refused_fields(dry_run(client, keys, missing)) == ["dataset.data_files.train"]
    put(settings, "stars/train.csv", b"body,stars\nok,5\nbad,1\n")
    columns = make_spec(dataset={"path": "csv", "data_files": {"train": "stars/*.csv"}})
    problem = dry_run(client, keys, columns)
    assert refused_fields(problem) == ["dataset.text_column"] and "body, stars" in problem.json()["detail"]
    put(settings, "bad/train.parquet", b"this is not parquet")
    unparsable = make_spec(dataset={"path": "parquet", "data_files": {"train": "bad/train.parquet"}})
    assert "cannot parse" in dry_run(client, keys, unparsable).json()["detail"]
    # A folder on the store: listed there, and its images decoded from there.
    images = write_image_folder(tmp_path / "images", n_train_per_class=2, n_val_per_class=1)
    for png in (images / "train").rglob("*.png"):
        png.write_bytes(b"not an image at all")
    DataStore.of(settings).put_folder(images, "images")
    folder = {"name": "img", "task": "image-classification", "model": {"config": TINY_VIT},
              "dataset": {"path": "imagefolder", "data_dir": "images"}}  # fmt: skip
    problem = dry_run(client, keys, folder)
    assert refused_fields(problem) == ["dataset.data_dir"] and "cannot decode" in problem.json()["detail"]
    assert session.execute(select(func.count()).select_from(Job)).scalar_one() == 0


def test_a_model_folder_on_the_store_resolves_through_this_hosts_cache(
    client: TestClient, keys: Keys, settings: Settings, tiny_model: Path
) -> None:
    DataStore.of(settings).put_folder(tiny_model, "models/tiny")
    root = settings.data_root_url
    for name in ("models/tiny", f"{root}/models/tiny"):
        spec = make_spec(model={"name_or_path": name})
        report = dry_run(client, keys, spec)
        assert report.status_code == 200, report.text
        assert report.json()["spec"]["model"] == {"name_or_path": f"{root}/models/tiny"}  # stored as the URL
        assert report.json()["preflight"]["model"] == {"model": "local", "tokenizer": "local"}
        assert report.json()["estimate"] is not None
    cached = [p for p in (settings.home / CACHE_DIR).iterdir() if not p.name.startswith(".")]
    assert len(cached) == 1 and (cached[0] / "config.json").is_file()  # fetched once for both
    assert refused_fields(dry_run(client, keys, make_spec(model={"name_or_path": f"{root}/models/none"}))) == [
        "model.name_or_path"
    ]
    estimate = client.post("/v1/estimates/memory", json={"spec": make_spec(model={"name_or_path": "models/tiny"})},
                           headers=keys.auth(keys.alice))  # fmt: skip
    assert estimate.status_code == 200, estimate.text


def test_the_launchers_example_is_placed_in_the_store_and_passes_preflight(
    client: TestClient, keys: Keys, settings: Settings
) -> None:
    example = json.loads(write_example(settings).read_text())
    assert example["model"]["name_or_path"] == f"{settings.data_root_url}/models/all-MiniLM-L6-v2"
    assert read(settings, "examples/sentiment-train.csv").startswith(b"text,label")
    for spec in (example, json.loads(json.dumps(EXAMPLE_JOB_CREATE))):  # by URL, and Swagger's relative names
        response = dry_run(client, keys, spec)
        assert response.status_code == 200, response.text
        assert response.json()["preflight"]["labels"] == ["negative", "positive"]


def test_preflight_sees_objects_written_since_it_last_looked(
    client: TestClient, keys: Keys, settings: Settings
) -> None:
    # Another host writes to the store: a long-lived API process must not answer from an old listing.
    put(settings, "growing/a.csv", CSV)
    spec = make_spec(dataset={"path": "csv", "data_files": {"train": "growing/*.csv"}})
    assert dry_run(client, keys, spec).json()["preflight"]["splits"]["train"]["rows"] == 3
    put(settings, "growing/b.csv", CSV)
    assert dry_run(client, keys, spec).json()["preflight"]["splits"]["train"]["rows"] == 6
    # A named file's passing report is reused only while the object's ETag is the same.
    one = make_spec(dataset={"path": "csv", "data_files": {"train": "growing/a.csv"}})
    assert dry_run(client, keys, one).status_code == 200
    put(settings, "growing/a.csv", b"body,label\nok,1\nbad,0\n")
    assert refused_fields(dry_run(client, keys, one)) == ["dataset.text_column"]


def test_a_store_that_does_not_answer_is_a_503_not_a_500(
    client: TestClient, keys: Keys, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    S3FileSystem.clear_instance_cache()  # clients are cached with the endpoint they were made with
    try:
        response = client.post("/v1/jobs", json=make_spec(), headers=keys.auth(keys.alice))
    finally:
        S3FileSystem.clear_instance_cache()  # the next test's clients reach the real store again
    assert response.status_code == 503, response.text
    assert "did not answer" in response.json()["detail"] and response.headers["Retry-After"] == "5"
