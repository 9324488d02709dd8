"""A job's local paths are checked again by its run (trainer_core/path_guard.py), with the reach of the
job's owner: a data file swapped for a link to an outside file while the job waits in the queue fails
the job with ``data_error`` naming the field, and nothing of the outside file is trained on.

Submitted over HTTP to the real app, then executed by the worker's own code (claim, run process,
outcome) on SQLite and PostgreSQL; the run is a real ``python -m trainer_core`` process.
"""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from api.main import create_app
from service_core.db.session import session_scope
from service_core.keys import create_api_key
from service_core.settings import Settings
from tests.trainer_core.datagen import tiny_text_spec, write_sentiment_csv
from trainer_core.path_guard import Reach
from worker.execute import execute_job
from worker.paths import run_paths, run_reach
from worker.supervisor import train_args

from .conftest import load_job, make_settings


def submit_as(settings: Settings, owner: str, admin: bool, spec: dict[str, object]) -> str:
    with session_scope(settings.database_url) as session:
        key = create_api_key(session, owner, admin, settings=settings)
    with TestClient(create_app(settings)) as client:
        created = client.post("/v1/jobs", json=spec, headers={"Authorization": f"Bearer {key}"})
    assert created.status_code == 201, created.text
    assert created.json()["status"] == "queued"
    return str(created.json()["id"])


def test_a_file_swapped_for_a_link_while_the_job_is_queued_fails_the_run(db_settings: Settings, tmp_path: Path) -> None:
    settings = db_settings
    folder = tmp_path.name  # the data root is the session's: a folder of this test's own
    write_sentiment_csv(settings.data_root / folder, n_train=16, n_val=8)
    outside = tmp_path / "outside.csv"
    outside.write_text("text,label\n" + "".join(f"secret {i},{('spam', 'ham')[i % 2]}\n" for i in range(16)))
    spec = tiny_text_spec(
        {"train": f"{folder}/train.csv", "validation": f"{folder}/validation.csv"},
        training={"max_steps": 2, "per_device_train_batch_size": 4, "logging_steps": 1},
    )
    job_id = submit_as(settings, "bob", False, spec)
    train = settings.data_root / folder / "train.csv"  # checked at submit, swapped while the job waits
    train.unlink()
    train.symlink_to(outside)

    assert execute_job(job_id, settings) == "failed"
    job = load_job(settings, job_id)
    assert job.error_reason == "data_error", job.error_message
    assert "dataset.data_files.train" in str(job.error_message)
    assert "resolves outside the data root" in str(job.error_message)
    artifacts = Path(settings.artifacts_root) / job_id
    assert not (artifacts / "config.json").exists()  # no model (with id2label from spam/ham) was written


def test_the_run_gets_its_owners_reach(tmp_path: Path) -> None:
    settings = make_settings(tmp_path)
    root = settings.data_root.as_posix()
    bob = train_args(run_paths("j1", settings, run_reach(settings, "bob", reads_all_uploads=False)), resume=False)
    assert bob[-4:] == ["--data-root", root, "--owner", "bob"]
    # An admin's job may read every upload, as the submit's check let it: the data root alone.
    admin = train_args(run_paths("j2", settings, run_reach(settings, "root", reads_all_uploads=True)), resume=False)
    assert admin[-2:] == ["--data-root", root] and "--owner" not in admin
    # On an object-store data root the run reads only this host's cache of it.
    store = make_settings(tmp_path, DATA_ROOT="s3://bucket/data")
    cache = (tmp_path.resolve() / "cache" / "data").as_posix()
    assert run_reach(store, "bob", reads_all_uploads=False) == Reach(cache)


def test_an_admins_submit_is_stored_with_every_upload_in_reach(db_settings: Settings, tmp_path: Path) -> None:
    write_sentiment_csv(db_settings.data_root / tmp_path.name, n_train=16, n_val=8)
    spec = tiny_text_spec({"train": f"{tmp_path.name}/train.csv"}, training={"max_steps": 1})
    assert load_job(db_settings, submit_as(db_settings, "root", True, spec)).reads_all_uploads is True
    assert load_job(db_settings, submit_as(db_settings, "bob", False, spec)).reads_all_uploads is False
