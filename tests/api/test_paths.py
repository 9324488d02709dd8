"""What a job may read: data-root paths, hub ids and public URLs; the rest is a 422 naming the field."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.paths import check_spec_locations
from service_core.db.models import Job
from service_core.settings import Settings
from tests.api.conftest import Keys, make_spec
from trainer_core.net_guard import host_problem as address_problem
from trainer_core.spec import JobSpec, SpecError

ROOT = Path("/srv/data")


def checked(**overrides: Any) -> dict[str, Any]:
    return check_spec_locations(JobSpec.model_validate(make_spec(**overrides)), ROOT).model_dump(exclude_unset=True)


def refused_fields(**overrides: Any) -> list[str]:
    with pytest.raises(SpecError) as caught:
        checked(**overrides)
    return [e.field for e in caught.value.errors]


@pytest.mark.parametrize(
    ("dataset", "field"),
    [
        ({"path": "csv", "data_files": "/etc/passwd"}, "dataset.data_files"),
        ({"path": "csv", "data_files": {"train": "../alice/x.csv"}}, "dataset.data_files.train"),
        ({"path": "csv", "data_files": ["ok.csv", "/srv/data/../secret.csv"]}, "dataset.data_files.1"),
        ({"path": "csv", "data_files": "file:///srv/data/x.csv"}, "dataset.data_files"),
        ({"path": "csv", "data_files": "http://127.0.0.1:9000/x.csv"}, "dataset.data_files"),
        ({"path": "csv", "data_files": "http://localhost/x.csv"}, "dataset.data_files"),
        ({"path": "csv", "data_files": "http://10.1.2.3/x.csv"}, "dataset.data_files"),
        ({"path": "csv", "data_files": "http://169.254.169.254/latest/meta-data"}, "dataset.data_files"),
        ({"path": "csv", "data_files": "http://[::1]/x.csv"}, "dataset.data_files"),
        ({"path": "csv", "data_files": "http://2130706433/x.csv"}, "dataset.data_files"),
        ({"path": "csv", "data_files": "ftp://example.org/x.csv"}, "dataset.data_files"),
        ({"path": "imagefolder", "data_dir": "/home/bob/pics"}, "dataset.data_dir"),
        ({"path": "/srv/other"}, "dataset.path"),
    ],
)
def test_forbidden_dataset_locations(dataset: dict[str, Any], field: str) -> None:
    assert refused_fields(dataset=dataset) == [field]


def test_forbidden_model_locations() -> None:
    assert refused_fields(model={"name_or_path": "/opt/models/bert"}) == ["model.name_or_path"]
    assert refused_fields(model={"name_or_path": "bert-base-uncased", "tokenizer": "../tok"}) == ["model.tokenizer"]


def test_every_bad_location_is_reported_at_once() -> None:
    fields = refused_fields(
        model={"name_or_path": "/root/m"},
        dataset={"path": "csv", "data_files": {"train": "/etc/a.csv", "validation": "file:///b.csv"}},
    )
    assert fields == ["model.name_or_path", "dataset.data_files.train", "dataset.data_files.validation"]


def test_allowed_locations_and_relative_paths_made_absolute(tmp_path: Path) -> None:
    (tmp_path / "models" / "minilm").mkdir(parents=True)
    spec = check_spec_locations(
        JobSpec.model_validate(
            make_spec(
                model={"name_or_path": "models/minilm", "tokenizer": "bert-base-uncased"},
                dataset={"path": "csv", "data_files": {"train": "r/train.csv", "validation": f"{tmp_path}/r/val.csv"}},
            )
        ),
        tmp_path,
    ).model_dump(exclude_unset=True)
    assert spec["model"] == {"name_or_path": f"{tmp_path}/models/minilm", "tokenizer": "bert-base-uncased"}
    assert spec["dataset"]["data_files"] == {"train": f"{tmp_path}/r/train.csv", "validation": f"{tmp_path}/r/val.csv"}
    hub = checked(dataset={"path": "imdb"}, model={"name_or_path": "google/electra-small-discriminator"})
    assert hub["dataset"]["path"] == "imdb"
    assert hub["model"]["name_or_path"] == "google/electra-small-discriminator"
    # data files of a hub dataset are relative to its repository, not to this machine
    repo_files = checked(dataset={"path": "org/reviews", "data_files": "data/train.csv"})
    assert repo_files["dataset"]["data_files"] == "data/train.csv"
    public = checked(dataset={"path": "csv", "data_files": ["https://93.184.216.34/x.csv", "hf://datasets/o/r/a.csv"]})
    assert public["dataset"]["data_files"] == ["https://93.184.216.34/x.csv", "hf://datasets/o/r/a.csv"]


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "10.0.0.1", "192.168.1.1", "172.16.0.1", "169.254.1.1", "::1", "0.0.0.0"]
)
def test_address_problem_refuses_internal_addresses(host: str) -> None:
    assert address_problem(host) is not None


def test_address_problem_allows_public_addresses() -> None:
    assert address_problem("93.184.216.34") is None
    assert address_problem("2606:4700::1111") is None


def test_submit_with_forbidden_path_stores_nothing(client: TestClient, keys: Keys) -> None:
    spec = make_spec(dataset={"path": "csv", "data_files": {"train": "/etc/passwd"}})
    response = client.post("/v1/jobs", json=spec, headers=keys.auth(keys.alice))
    assert response.status_code == 422
    assert response.json()["errors"][0]["field"] == "dataset.data_files.train"
    assert client.get("/v1/jobs", headers=keys.auth(keys.alice)).json()["items"] == []


@pytest.mark.parametrize(
    "url",
    [
        "http://metadata.google.internal/computeMetadata/v1/instance/service-accounts/default/token",
        "http://metadata.google.internal./computeMetadata/v1/",
        "http://METADATA/computeMetadata/v1/",
        "http://instance-data/latest/meta-data/",
        "http://instance-data.ec2.internal/latest/meta-data/",
        "http://redis:6379/x.csv",
        "http://kubernetes.default.svc/api",
        "http://printer.local/x.csv",
    ],
)
def test_submit_naming_a_metadata_or_internal_host_is_422(client: TestClient, keys: Keys, url: str) -> None:
    spec = make_spec(dataset={"path": "csv", "data_files": {"train": url}})
    response = client.post("/v1/jobs", json=spec, headers=keys.auth(keys.alice))
    assert response.status_code == 422, response.text
    assert response.json()["errors"][0]["field"] == "dataset.data_files.train"


def test_public_names_that_do_not_resolve_here_are_left_to_the_worker() -> None:
    assert address_problem("data.example.org") is None


def test_data_root_is_a_local_folder_or_an_object_store_url(tmp_path: Path) -> None:
    from pydantic import ValidationError

    local = Settings.model_validate({"DATA_ROOT": tmp_path / "data"})
    assert local.data_root == (tmp_path / "data").resolve() and local.data_root_url == local.data_root.as_posix()
    assert Settings.model_validate({"DATA_ROOT": f"file://{tmp_path}/d"}).data_root == (tmp_path / "d").resolve()
    store = Settings.model_validate({"DATA_ROOT": "s3://bucket/data/"})
    assert store.data_root_url == "s3://bucket/data"
    with pytest.raises(ValueError, match="not a local folder"):
        _ = store.data_root  # code that needs a local folder says so instead of writing to a wrong place
    with pytest.raises(ValidationError, match="DATA_ROOT"):
        Settings.model_validate({"DATA_ROOT": "nosuchproto://bucket/data"})


TINY_VIT = {"model_type": "vit", "image_size": 32, "patch_size": 8, "hidden_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 2, "intermediate_size": 37}  # fmt: skip
# Each path field, with the path put in it, and the name the 422 gives it.
PATH_FIELDS: dict[str, tuple[Callable[[str], dict[str, Any]], str]] = {
    "model.name_or_path": (lambda p: make_spec(model={"name_or_path": p}), "model.name_or_path"),
    "model.tokenizer": (lambda p: make_spec(model={**make_spec()["model"], "tokenizer": p}), "model.tokenizer"),
    "model.processor": (
        lambda p: make_spec(
            task="image-classification",
            model={"config": TINY_VIT, "processor": p},
            dataset={"path": "imagefolder", "data_dir": "pics"},
        ),
        "model.processor",
    ),
    "dataset.path": (lambda p: make_spec(dataset={"path": p}), "dataset.path"),
    "dataset.data_dir": (lambda p: make_spec(dataset={"path": "csv", "data_dir": p}), "dataset.data_dir"),
    "dataset.data_files": (
        lambda p: make_spec(dataset={"path": "csv", "data_files": {"train": p}}), "dataset.data_files.train"
    ),
}


@pytest.mark.both_databases
@pytest.mark.parametrize("field", list(PATH_FIELDS))
def test_paths_the_file_system_refuses_are_422_naming_the_field(
    client: TestClient, keys: Keys, settings: Settings, session: Session, field: str
) -> None:
    """ENAMETOOLONG, ELOOP, ENOTDIR in any path field: a 422 with the OS's reason, not a 500 (issue 31)."""
    root = settings.data_root
    (root / "loop").symlink_to("loop")
    spec_with, named = PATH_FIELDS[field]
    for path, reason in [
        (f"{root}/{'a' * 300}", "ENAMETOOLONG"),  # the data root plus 300 a's: was a 500 at locate.py
        ("a" * 300, "ENAMETOOLONG"),  # relative: under the root, or taken for a hub id
        (f"{root}/loop/x", "ELOOP"),
        (f"{root}/reviews/train.csv/x", "ENOTDIR"),
    ]:
        for query in ("?dry_run=true", ""):
            response = client.post(f"/v1/jobs{query}", json=spec_with(path), headers=keys.auth(keys.bob))
            assert response.status_code == 422, (path, response.text)
            errors = response.json()["errors"]
            assert [e["field"] for e in errors] == [named], errors
            assert reason in errors[0]["message"] and "file system refuses" in errors[0]["message"]
    assert session.execute(select(func.count()).select_from(Job)).scalar_one() == 0


@pytest.mark.both_databases
def test_a_name_that_is_neither_a_folder_nor_a_hub_id_is_422(client: TestClient, keys: Keys) -> None:
    # 200 characters: the file system takes it, the hub's id rules (96 at most) do not; was a 500 too.
    for field in ("name_or_path", "tokenizer"):
        spec = make_spec(model={"name_or_path": "b" * 200} if field == "name_or_path" else
                         {**make_spec()["model"], "tokenizer": "b" * 200})  # fmt: skip
        response = client.post("/v1/jobs?dry_run=true", json=spec, headers=keys.auth(keys.bob))
        assert response.status_code == 422, response.text
        assert [e["field"] for e in response.json()["errors"]] == [f"model.{field}"]
