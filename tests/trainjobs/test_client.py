"""Client pieces that need no service: problem+json errors, spec payloads, folder zips, giving up."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import httpx
import pytest

from trainer_core.spec import parse_spec
from trainjobs.client import ApiError, Client, ConnectionFailed, spec_payload, zip_folder


def test_problem_details_become_an_error_with_field_lines() -> None:
    response = httpx.Response(
        422,
        headers={"content-type": "application/problem+json"},
        json={
            "type": "urn:trainjobs:problem:validation",
            "title": "Invalid job spec",
            "status": 422,
            "detail": "training.learning_rate: Input should be greater than 0",
            "errors": [{"field": "training.learning_rate", "message": "Input should be greater than 0"}],
        },
    )
    error = ApiError.from_response(response)
    assert error.status == 422 and error.title == "Invalid job spec"
    assert error.lines() == ["training.learning_rate: Input should be greater than 0"]
    assert str(error) == "Invalid job spec (422)\ntraining.learning_rate: Input should be greater than 0"


def test_a_non_json_error_body_still_reads() -> None:
    error = ApiError.from_response(httpx.Response(502, text="<html>bad gateway</html>"))
    assert error.status == 502 and error.title == "Bad Gateway"
    assert "bad gateway" in str(error)


def test_a_parsed_spec_is_sent_with_only_the_fields_the_user_set(tmp_path: Path) -> None:
    # Sending defaults would trip rules that depend on what was given (Adam options with Adafactor).
    spec = parse_spec({
        "name": "a", "task": "text-classification", "model": {"name_or_path": "bert-base-uncased"},
        "dataset": {"path": "csv", "data_files": "x.csv"}, "optimizer": {"name": "adafactor"},
    })  # fmt: skip
    payload = spec_payload(spec)
    assert payload["optimizer"] == {"name": "adafactor"} and "training" not in payload
    parse_spec(payload)  # and it is still valid
    yaml_file = tmp_path / "job.yaml"
    yaml_file.write_text("name: a\ntask: text-classification\n")
    assert spec_payload(yaml_file) == {"name": "a", "task": "text-classification"}


def test_a_folder_is_zipped_with_relative_names(tmp_path: Path) -> None:
    (tmp_path / "train" / "red").mkdir(parents=True)
    (tmp_path / "train" / "red" / "0.png").write_bytes(b"png")
    (tmp_path / "validation").mkdir()
    (tmp_path / "validation" / "labels.txt").write_text("red")
    archive = zipfile.ZipFile(io.BytesIO(zip_folder(tmp_path)))
    assert sorted(archive.namelist()) == ["train/red/0.png", "validation/labels.txt"]
    assert archive.read("train/red/0.png") == b"png"


def test_following_gives_up_when_the_service_stays_away() -> None:
    client = Client("http://127.0.0.1:9", "key", retry_max_s=0.5)
    with pytest.raises(ConnectionFailed, match="lost the event stream"):
        list(client.events("job"))
    with pytest.raises(ConnectionFailed, match="cannot reach"):
        client.get("job")
