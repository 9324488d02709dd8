"""Patterns, folders and links cannot reach another owner's upload (what `datasets` would expand), on a
local data root and on an object-store one (SeaweedFS), where URLs outside the root are refused too."""

from __future__ import annotations

import os
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service_core.db.models import Dataset, Job
from service_core.settings import Settings
from tests.api.conftest import Keys, make_spec
from tests.api.stores import put, settings_on_both_roots  # noqa: F401 (every test here runs on both roots)

CSV = b"text,label\nbob's private text,1\nmore private text,0\n"  # two labels: preflight wants a classification


def bobs_upload(client: TestClient, keys: Keys, session: Session) -> str:
    """Bob uploads a CSV through the API; returns its storage path relative to the data root."""
    response = client.post("/v1/datasets", files={"file": ("secret.csv", CSV)}, headers=keys.auth(keys.bob))
    assert response.status_code == 201, response.text
    row = session.get(Dataset, response.json()["id"])
    assert row is not None
    return row.storage_path


def submit(client: TestClient, key: str, dataset: dict[str, Any]) -> Any:
    return client.post("/v1/jobs", json=make_spec(dataset=dataset), headers=Keys.auth(key))


def assert_refused(response: Any, field: str) -> None:
    assert response.status_code == 422, response.text
    assert [e["field"] for e in response.json()["errors"]] == [field]


def test_patterns_cannot_reach_another_owners_upload(
    client: TestClient, keys: Keys, settings: Settings, session: Session
) -> None:
    stored = bobs_upload(client, keys, session)  # uploads/bob/<id>/secret.csv
    dataset_id = stored.split("/")[2]
    root = settings.data_root_url
    patterns = [
        "upload[s]/bob/*/secret.csv",
        f"uploads/bob/{dataset_id}/secre?.csv",
        "uploads/*/*/secret.csv",
        "**/secret.csv",
        "*/bob/**",
        "u?loads/bob/**/*.csv",
        "[u]ploads/[!a]ob/*/*.csv",
        "{uploads,x}/bob/*/secret.csv",
        "upload%73/bob/*/secret.csv",
        "%2A%2A/secret.csv",
        f"{root}/upload[s]/bob/*/secret.csv",
        f"{root}/**/*.csv",
    ]
    for pattern in patterns:
        assert_refused(
            submit(client, keys.alice, {"path": "csv", "data_files": {"train": pattern}}), "dataset.data_files.train"
        )
        assert_refused(submit(client, keys.alice, {"path": "csv", "data_files": [pattern]}), "dataset.data_files.0")
    # Folders the loader reads recursively: the data root or the uploads area holds bob's files.
    for folder in (".", "uploads", root, f"{root}/uploads/bob"):
        assert_refused(submit(client, keys.alice, {"path": "csv", "data_dir": folder}), "dataset.data_dir")
    assert_refused(submit(client, keys.alice, {"path": root}), "dataset.path")
    assert session.execute(select(func.count()).select_from(Job)).scalar_one() == 0


@pytest.mark.parametrize("settings", ["local"], indirect=True)  # an object store has no links
def test_a_link_into_another_owners_upload_is_refused(
    client: TestClient, keys: Keys, settings: Settings, session: Session
) -> None:
    stored = bobs_upload(client, keys, session)
    shared = settings.data_root / "shared"
    shared.mkdir()
    os.symlink(settings.data_root / stored, shared / "train.csv")
    assert_refused(submit(client, keys.alice, {"path": "csv", "data_files": "shared/train.csv"}), "dataset.data_files")
    assert_refused(submit(client, keys.alice, {"path": "csv", "data_files": "shared/*.csv"}), "dataset.data_files")
    assert_refused(submit(client, keys.alice, {"path": "csv", "data_dir": "shared"}), "dataset.data_dir")


def test_patterns_in_own_folders_and_shared_folders_are_allowed(
    client: TestClient, keys: Keys, settings: Settings, session: Session
) -> None:
    bobs_upload(client, keys, session)
    mine = client.post("/v1/datasets", files={"file": ("mine.csv", CSV)}, headers=keys.auth(keys.alice))
    assert mine.status_code == 201, mine.text
    put(settings, "shared/train.csv", CSV)  # a folder of its own: the fixture's reviews/ holds other data
    for dataset in (
        {"path": "csv", "data_files": "uploads/alice/*/*.csv"},
        {"path": "csv", "data_files": {"train": "shared/*.csv"}},
        {"path": "csv", "data_files": "shared/**"},
        {"path": "csv", "data_dir": "shared"},
    ):
        response = submit(client, keys.alice, dataset)
        assert response.status_code == 201, (dataset, response.text)
    # An admin may read any upload, patterns included.
    admin = submit(client, keys.admin, {"path": "csv", "data_files": "uploads/*/*/secret.csv"})
    assert admin.status_code == 201, admin.text


def test_a_pattern_the_loader_cannot_read_is_422(client: TestClient, keys: Keys) -> None:
    # fsspec refuses `**` inside a name: a 422 naming the field, not a failed run later.
    assert_refused(submit(client, keys.alice, {"path": "csv", "data_files": "reviews/a**b.csv"}), "dataset.data_files")


@pytest.mark.parametrize("settings", ["s3"], indirect=True)
def test_object_store_urls_must_lie_under_the_data_root(
    client: TestClient, keys: Keys, settings: Settings, session: Session
) -> None:
    stored = bobs_upload(client, keys, session)
    root = settings.data_root_url
    bucket = root.split("/")[2]
    refused = [
        f"s3://{bucket}/elsewhere/train.csv",  # the service's own bucket, outside DATA_ROOT
        f"s3a://{bucket}/elsewhere/*.csv",  # another spelling of the same store
        f"{root}-sibling/train.csv",  # a prefix that only starts like the root
        f"{root}/reviews/../{stored}",  # object keys are literal: `..` is refused, not resolved
        f"{root}/{stored}",  # bob's upload, by URL
        f"s3a://{root.removeprefix('s3://')}/uploads/*/*/secret.csv",
        settings.home.as_posix() + "/data/reviews/train.csv",  # a local path: there is no local data root
    ]
    for location in refused:
        assert_refused(submit(client, keys.alice, {"path": "csv", "data_files": location}), "dataset.data_files")
    # A model folder in the store is fetched whole: outside the root, or holding bob's upload, refused.
    for model in (f"s3://{bucket}/models/minilm", root, "uploads"):
        response = client.post("/v1/jobs", json=make_spec(model={"name_or_path": model}), headers=keys.auth(keys.alice))
        assert_refused(response, "model.name_or_path")
    # The root's own data by URL, in either spelling, is stored in the root's canonical form.
    own = submit(
        client, keys.alice, {"path": "csv", "data_files": f"s3a://{root.removeprefix('s3://')}/reviews/train.csv"}
    )
    assert own.status_code == 201, own.text
    assert own.json()["spec"]["dataset"]["data_files"] == f"{root}/reviews/train.csv"
