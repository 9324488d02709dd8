"""Dataset uploads (file and zipped folder), their limits and safety, and jobs that use them."""

from __future__ import annotations

import hashlib
import io
import stat
import zipfile
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service_core.db.models import Dataset, Job
from service_core.settings import Settings
from tests.api.conftest import UPLOAD_LIMIT_MB, Keys, make_spec

CSV = b"text,label\ngreat film,1\nawful film,0\n"


def upload(client: TestClient, key: str, filename: str, content: bytes, name: str | None = None) -> Any:
    data = {"name": name} if name else None
    return client.post("/v1/datasets", files={"file": (filename, content)}, data=data, headers=Keys.auth(key))


def zip_bytes(members: dict[str, bytes], links: tuple[str, ...] = ()) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for name, content in members.items():
            zf.writestr(name, content)
        for name in links:
            info = zipfile.ZipInfo(name)
            info.external_attr = (stat.S_IFLNK | 0o777) << 16
            zf.writestr(info, "/etc/passwd")
    return buffer.getvalue()


def count_datasets(session: Session) -> int:
    return session.execute(select(func.count()).select_from(Dataset)).scalar_one()


def test_upload_csv_stores_file_and_hash(client: TestClient, keys: Keys, settings: Settings, session: Session) -> None:
    response = upload(client, keys.alice, "reviews.csv", CSV, name="reviews")
    assert response.status_code == 201, response.text
    body = response.json()
    assert (body["name"], body["format"], body["owner"]) == ("reviews", "csv", "alice")
    assert body["content_hash"] == hashlib.sha256(CSV).hexdigest()
    assert body["size_bytes"] == len(CSV)
    row = session.get(Dataset, body["id"])
    assert row is not None
    stored = settings.data_root / row.storage_path
    assert stored.parent == settings.data_root / "uploads" / "alice" / body["id"]
    assert stored.read_bytes() == CSV


def test_upload_zip_of_image_folder(client: TestClient, keys: Keys, settings: Settings, session: Session) -> None:
    archive = zip_bytes({"pets/cat/1.png": b"\x89PNG-cat", "pets/dog/1.png": b"\x89PNG-dog", "__MACOSX/x": b""})
    response = upload(client, keys.alice, "pets.zip", archive)
    assert response.status_code == 201, response.text
    assert response.json()["format"] == "imagefolder"
    assert response.json()["content_hash"] == hashlib.sha256(archive).hexdigest()
    row = session.get(Dataset, response.json()["id"])
    assert row is not None
    folder = settings.data_root / row.storage_path
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.png")) == [
        "pets/cat/1.png",
        "pets/dog/1.png",
    ]
    assert not (folder / "__MACOSX").exists()


def test_upload_zip_of_audio_folder(client: TestClient, keys: Keys) -> None:
    response = upload(client, keys.alice, "tones.zip", zip_bytes({"low/a.wav": b"RIFF", "high/b.wav": b"RIFF"}))
    assert response.status_code == 201, response.text
    assert response.json()["format"] == "audiofolder"


def test_zip_slip_and_links_are_refused(client: TestClient, keys: Keys, settings: Settings, session: Session) -> None:
    for archive in (
        zip_bytes({"cat/1.png": b"x", "../../evil.png": b"x"}),
        zip_bytes({"/abs/evil.png": b"x"}),
        zip_bytes({"cat/1.png": b"x"}, links=("cat/link.png",)),
    ):
        response = upload(client, keys.alice, "bad.zip", archive)
        assert response.status_code == 422, response.text
        assert response.json()["errors"][0]["field"] == "file"
    assert count_datasets(session) == 0
    assert not (settings.data_root.parent / "evil.png").exists()
    # Judged from the zip's directory before anything is written: not even the owner's folder is made.
    assert not (settings.data_root / "uploads" / "alice").exists()


def test_unsupported_and_mixed_uploads_are_refused(client: TestClient, keys: Keys) -> None:
    assert upload(client, keys.alice, "model.bin", b"xx").status_code == 422
    mixed = upload(client, keys.alice, "mixed.zip", zip_bytes({"a/1.png": b"x", "b/1.wav": b"x"}))
    assert mixed.status_code == 422 and "one of them" in mixed.json()["detail"]
    assert upload(client, keys.alice, "broken.zip", b"not a zip").status_code == 422


def test_upload_over_the_limit_is_413(client: TestClient, keys: Keys, session: Session) -> None:
    limit = UPLOAD_LIMIT_MB << 20
    # Refused by its Content-Length before the body is read...
    big = upload(client, keys.alice, "big.csv", b"x" * (limit + 200_000))
    # ...or while it is copied, when the envelope hides the excess.
    just_over = upload(client, keys.alice, "over.csv", b"x" * (limit + 1))
    for response in (big, just_over):
        assert response.status_code == 413
        assert response.headers["content-type"] == "application/problem+json"
    assert count_datasets(session) == 0
    assert upload(client, keys.alice, "fits.csv", b"x" * (limit - 1000)).status_code == 201


def test_get_and_list_datasets_trio(client: TestClient, keys: Keys) -> None:
    mine = upload(client, keys.alice, "a.csv", CSV).json()
    upload(client, keys.bob, "b.csv", CSV)
    assert client.get(f"/v1/datasets/{mine['id']}", headers=keys.auth(keys.alice)).json()["id"] == mine["id"]
    assert client.get("/v1/datasets/nope", headers=keys.auth(keys.alice)).status_code == 404
    assert client.get(f"/v1/datasets/{mine['id']}", headers=keys.auth(keys.bob)).status_code == 404
    assert client.get(f"/v1/datasets/{mine['id']}").status_code == 401
    assert [d["id"] for d in client.get("/v1/datasets", headers=keys.auth(keys.alice)).json()["items"]] == [mine["id"]]
    assert len(client.get("/v1/datasets", headers=keys.auth(keys.admin)).json()["items"]) == 2
    assert upload(client, "tj_wrong", "c.csv", CSV).status_code == 401


def test_job_uses_uploaded_dataset_by_id(client: TestClient, keys: Keys, settings: Settings, session: Session) -> None:
    dataset = upload(client, keys.alice, "reviews.csv", CSV).json()
    spec = make_spec(dataset={"id": dataset["id"], "text_column": "text"})
    response = client.post("/v1/jobs", json=spec, headers=keys.auth(keys.alice))
    assert response.status_code == 201, response.text
    stored = response.json()["spec"]["dataset"]
    row = session.get(Dataset, dataset["id"])
    assert row is not None
    assert stored == {
        "path": "csv",
        "data_files": {"train": (settings.data_root / row.storage_path).as_posix()},
        "text_column": "text",
    }
    job = session.get(Job, response.json()["id"])
    assert job is not None and job.dataset_id == dataset["id"]
    assert Path(stored["data_files"]["train"]).read_bytes() == CSV


def test_job_cannot_use_another_owners_dataset(client: TestClient, keys: Keys, session: Session) -> None:
    dataset = upload(client, keys.alice, "reviews.csv", CSV).json()
    response = client.post("/v1/jobs", json=make_spec(dataset={"id": dataset["id"]}), headers=keys.auth(keys.bob))
    assert response.status_code == 422
    assert response.json()["errors"][0]["field"] == "dataset.id"
    both = make_spec(dataset={"id": dataset["id"], "data_files": "x.csv"})
    conflict = client.post("/v1/jobs", json=both, headers=keys.auth(keys.alice))
    assert conflict.status_code == 422 and conflict.json()["errors"][0]["field"] == "dataset.data_files"
    assert session.execute(select(func.count()).select_from(Job)).scalar_one() == 0


def test_job_cannot_name_another_owners_upload_by_path(client: TestClient, keys: Keys, session: Session) -> None:
    dataset = upload(client, keys.alice, "reviews.csv", CSV).json()
    row = session.get(Dataset, dataset["id"])
    assert row is not None
    for path in (row.storage_path, "uploads/alice"):
        spec = make_spec(dataset={"path": "csv", "data_files": path})
        response = client.post("/v1/jobs", json=spec, headers=keys.auth(keys.bob))
        assert response.status_code == 422
        assert response.json()["errors"][0]["field"] == "dataset.data_files"
    mine = client.post(
        "/v1/jobs",
        json=make_spec(dataset={"path": "csv", "data_files": row.storage_path}),
        headers=keys.auth(keys.alice),
    )
    assert mine.status_code == 201, mine.text
    admin = client.post(
        "/v1/jobs",
        json=make_spec(dataset={"path": "csv", "data_files": row.storage_path}),
        headers=keys.auth(keys.admin),
    )
    assert admin.status_code == 201, admin.text


def test_zip_that_inflates_past_the_limit_is_413(client: TestClient, keys: Keys, session: Session) -> None:
    # ~5 MiB of zeros compresses to a few KiB: under the upload limit, over the unpacked budget (4x).
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("cat/1.png", b"\0" * ((UPLOAD_LIMIT_MB << 20) * 5))
    assert len(buffer.getvalue()) < UPLOAD_LIMIT_MB << 20
    response = upload(client, keys.alice, "bomb.zip", buffer.getvalue())
    assert response.status_code == 413
    assert count_datasets(session) == 0


def test_zip_with_a_file_where_a_folder_should_be_is_422(client: TestClient, keys: Keys) -> None:
    response = upload(client, keys.alice, "clash.zip", zip_bytes({"cat": b"x", "cat/1.png": b"x"}))
    assert response.status_code == 422
    assert response.json()["errors"][0]["field"] == "file"


@pytest.mark.both_databases
def test_a_nul_in_the_name_or_file_name_is_a_422_and_stores_nothing(
    client: TestClient, keys: Keys, settings: Settings, session: Session
) -> None:
    # PostgreSQL's text columns refuse NUL: both were a 500 at INSERT (found by the schema fuzzer).
    by_name = upload(client, keys.alice, "reviews.csv", b"text,label\nok,pos\n", name="rev\x00iews")
    assert by_name.status_code == 422, by_name.text
    assert [e["field"] for e in by_name.json()["errors"]] == ["name"]
    # The name's other limit, its length (the fuzzer does not pin it: see test_schema_fuzz.MULTIPART).
    too_long = upload(client, keys.alice, "reviews.csv", b"text,label\nok,pos\n", name="n" * 257)
    assert too_long.status_code == 422, too_long.text
    assert [e["field"] for e in too_long.json()["errors"]] == ["name"]
    # httpx would percent-encode the NUL; a raw client sends it as is.
    body = (
        b'--b\r\nContent-Disposition: form-data; name="file"; filename="rev\x00iews.csv"\r\n\r\n'
        b"text,label\nok,pos\n\r\n--b--\r\n"
    )
    headers = {**Keys.auth(keys.alice), "Content-Type": "multipart/form-data; boundary=b"}
    by_file = client.post("/v1/datasets", content=body, headers=headers)
    assert by_file.status_code == 422, by_file.text
    assert [e["field"] for e in by_file.json()["errors"]] == ["file"]
    assert session.execute(select(Dataset)).scalars().all() == []
    assert not list((settings.data_root / "uploads").rglob("*.csv"))
