"""The time part of a job's estimate over HTTP (issue 29): the counted work of a dry run, seconds on the
queue's device at the prior efficiency, the efficiency learned from the queue's finished jobs, and the
job detail's predicted beside measured."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from api import estimation
from api.main import create_app
from service_core.db.models import Job
from service_core.settings import Settings
from service_core.status import JobStatus
from tests.api.conftest import Keys, add_job, make_spec
from trainer_core.time_estimate import PRIOR_EFFICIENCY, device_peak

PEAK = device_peak("A100-80GB", "fp32")


def dry_run_time(client: TestClient, keys: Keys, **overrides: Any) -> dict[str, Any]:
    response = client.post("/v1/jobs?dry_run=true", json=make_spec(**overrides), headers=keys.auth(keys.alice))
    assert response.status_code == 200, response.text
    counted: dict[str, Any] = response.json()["estimate"]["time"]
    return counted


@pytest.fixture
def on_a100(settings: Settings) -> Settings:
    return settings.model_copy(update={"queue_devices": {"default": "A100-80GB"}})


def test_a_dry_run_counts_the_work_and_says_it_cannot_time_it_without_device_or_history(
    client: TestClient, keys: Keys
) -> None:
    counted = dry_run_time(client, keys)
    # make_spec: max_steps 4, batch 4 on 32 rows: 4 steps of 4 samples; no eval split, so no eval.
    assert (counted["steps"], counted["train_samples"], counted["eval_samples"]) == (4, 16, 0)
    assert counted["train_flops"] == 16 * counted["flops_per_train_sample"] > 0
    assert counted["seconds"] is None and "TRAINJOBS_QUEUE_DEVICES" in counted["note"]
    spread = pytest.approx(counted["calibration"]["spread"])
    assert counted["calibration"] == {"jobs": 0, "calibrated": False, "efficiency": None, "overhead_s_per_step": 0.0,
                                      "scope": "queue", "spread": spread}  # fmt: skip
    assert counted["family"] == "bert"


def test_with_a_device_and_no_history_the_prior_times_it_and_says_so(on_a100: Settings, keys: Keys) -> None:
    with TestClient(create_app(on_a100)) as client:
        counted = dry_run_time(client, keys, training={"max_steps": 8, "per_device_train_batch_size": 4})
    assert counted["device"] == "A100-80GB" and counted["peak_flops"] == PEAK
    work = counted["train_flops"] + counted["eval_flops"]
    assert counted["seconds"] == pytest.approx(work / (PEAK * PRIOR_EFFICIENCY))
    assert counted["seconds_p10"] == pytest.approx(counted["seconds"] / 3)
    assert counted["seconds_p90"] == pytest.approx(counted["seconds"] * 3)
    assert counted["samples_per_second"] == pytest.approx(32 / counted["train_seconds"])
    assert "uncalibrated" in counted["note"]


def finished(
    db: Session, flops: float, seconds: float, status: JobStatus = JobStatus.succeeded, queue: str = "default"
) -> None:
    """A finished job of 100 samples whose submit counted ``flops`` and whose run trained ``seconds``."""
    counted = {"train_flops": flops, "eval_flops": 0.0, "train_samples": 100}
    add_job(db, "bob", status, queue=queue, estimate={"time": counted},
            final_metrics={"train_samples": 100, "train_runtime_s": seconds})  # fmt: skip


def test_the_queues_finished_jobs_set_the_rate(on_a100: Settings, keys: Keys) -> None:
    app = create_app(on_a100)
    with app.state.sessionmaker() as db:
        for flops, efficiency in ((4e15, 0.05), (1e16, 0.052), (2e16, 0.048)):
            finished(db, flops, seconds=flops / (PEAK * efficiency))
        # Another queue's job, and a job that failed: neither says anything about this queue's rate.
        finished(db, 1e16, seconds=1.0, queue="other")
        finished(db, 1e16, seconds=1.0, status=JobStatus.failed)
    with TestClient(app) as client:
        counted = dry_run_time(client, keys)
    calibration = counted["calibration"]
    assert calibration["calibrated"] is True and calibration["jobs"] == 3
    assert calibration["efficiency"] == pytest.approx(0.05, rel=1e-9)  # the median job's
    work = counted["train_flops"] + counted["eval_flops"]
    assert counted["seconds"] == pytest.approx(work / (PEAK * 0.05))
    assert counted["seconds_p10"] < counted["seconds"] < counted["seconds_p90"]
    assert "note" not in counted


def test_the_job_detail_shows_predicted_beside_measured(on_a100: Settings, keys: Keys) -> None:
    app = create_app(on_a100)
    with TestClient(app) as client:
        created = client.post("/v1/jobs", json=make_spec(), headers=keys.auth(keys.alice))
        assert created.status_code == 201, created.text
        job_id = created.json()["id"]
        shown = client.get(f"/v1/jobs/{job_id}", headers=keys.auth(keys.alice)).json()["time"]
        stored = created.json()["estimate"]["time"]
        assert shown == {"predicted_s": stored["seconds"], "p10_s": stored["seconds_p10"],
                         "p90_s": stored["seconds_p90"], "calibrated": False, "measured_s": None}  # fmt: skip
        with app.state.sessionmaker() as db:
            job = db.get(Job, job_id)
            assert job is not None
            job.final_metrics = {"train_runtime_s": 12.5, "train_samples": 16}
            db.commit()
        done = client.get(f"/v1/jobs/{job_id}", headers=keys.auth(keys.alice)).json()["time"]
    assert done["measured_s"] == 12.5 and done["predicted_s"] == stored["seconds"]


def test_an_unknown_device_in_the_setting_is_refused_at_start(settings: Settings) -> None:
    with pytest.raises(ValueError, match="unknown device"):
        Settings.model_validate({**settings.model_dump(by_alias=True), "TRAINJOBS_QUEUE_DEVICES": '{"gpu": "B9000"}'})


def test_the_estimate_endpoint_times_a_spec_given_its_rows(on_a100: Settings, keys: Keys) -> None:
    with TestClient(create_app(on_a100)) as client:
        submitted = dry_run_time(client, keys)  # preflight counts the 32 rows of make_spec's CSV
        body = {"spec": make_spec(), "train_rows": 32, "queue": "default"}
        answer = client.post("/v1/estimates", json=body, headers=keys.auth(keys.alice))
        assert answer.status_code == 200, answer.text
        assert answer.json()["estimate"]["time"] == submitted
        first_name = client.post("/v1/estimates/memory", json=body, headers=keys.auth(keys.alice))
        assert first_name.json() == answer.json()  # the old name keeps working
        without = client.post("/v1/estimates/memory", json={"spec": make_spec()}, headers=keys.auth(keys.alice))
        assert "time" not in without.json()["estimate"]  # the estimator never reads the data itself
        for bad, field in (({"train_rows": 0}, "train_rows"), ({"train_rows": 8, "queue": "no queue"}, "queue")):
            refused = client.post("/v1/estimates/memory", json={"spec": make_spec(), **bad},
                                  headers=keys.auth(keys.alice))  # fmt: skip
            assert refused.status_code == 422 and refused.headers["content-type"] == "application/problem+json"
            assert [e["field"] for e in refused.json()["errors"]] == [field], refused.text


def test_the_queues_jobs_with_steps_give_a_per_step_overhead(on_a100: Settings, keys: Keys) -> None:
    app = create_app(on_a100)
    overhead, efficiency = 0.05, 0.1
    with app.state.sessionmaker() as db:
        for steps, flops_per_step in ((100, 1e13), (400, 4e14), (50, 2e15), (200, 5e13)):
            flops = steps * flops_per_step
            counted = {"train_flops": flops, "eval_flops": 0.0, "train_samples": 100, "steps": steps}
            seconds = steps * overhead + flops / (PEAK * efficiency)
            add_job(db, "bob", JobStatus.succeeded, estimate={"time": counted},
                    final_metrics={"train_samples": 100, "train_runtime_s": seconds})  # fmt: skip
    with TestClient(app) as client:
        counted = dry_run_time(client, keys)
    calibration = counted["calibration"]
    assert calibration["overhead_s_per_step"] == pytest.approx(overhead, rel=1e-6)
    assert calibration["efficiency"] == pytest.approx(efficiency, rel=1e-6)
    work = counted["train_flops"] + counted["eval_flops"]
    assert counted["seconds"] == pytest.approx(counted["steps"] * overhead + work / (PEAK * efficiency))
    assert counted["train_seconds"] == pytest.approx(counted["seconds"])  # no eval split


def test_a_model_family_with_enough_jobs_is_timed_by_its_own(on_a100: Settings, keys: Keys) -> None:
    app = create_app(on_a100)
    with app.state.sessionmaker() as db:
        for family, efficiency, n in (("bert", 0.05, 3), ("llama", 0.2, 4)):
            for i in range(n):
                flops = 1e16 * (i + 1)
                counted = {"train_flops": flops, "eval_flops": 0.0, "train_samples": 100, "family": family}
                final = {"train_samples": 100, "train_runtime_s": flops / (PEAK * efficiency)}
                add_job(db, "bob", JobStatus.succeeded, estimate={"time": counted}, final_metrics=final)
    with TestClient(app) as client:
        bert = dry_run_time(client, keys)  # make_spec is a BERT
    assert bert["calibration"]["scope"] == "model family bert" and bert["calibration"]["jobs"] == 3
    assert bert["calibration"]["efficiency"] == pytest.approx(0.05)
    with app.state.sessionmaker() as db:  # the BERT history gone: the queue's seven jobs, mostly Llama
        for job in db.query(Job).filter(Job.status == JobStatus.succeeded.value).all():
            if job.estimate["time"]["family"] == "bert":
                job.estimate = {"time": {**job.estimate["time"], "family": "gpt2"}}
        db.commit()
    estimation._history.clear()  # each API process reads a queue's history at most once a minute
    with TestClient(create_app(on_a100)) as client:
        queued = dry_run_time(client, keys)
    assert queued["calibration"]["scope"] == "queue" and queued["calibration"]["jobs"] == 7
    assert queued["calibration"]["efficiency"] == pytest.approx(0.2)  # the median of 3 x 0.05 and 4 x 0.2


def test_a_dry_runs_time_estimate_counts_the_measured_positions(
    client: TestClient, keys: Keys, minilm_path: Path, settings: Settings
) -> None:
    model = Path(settings.data_root) / "minilm"
    shutil.copytree(minilm_path, model)
    spec = make_spec(model={"name_or_path": "minilm"}, preprocessing={"max_length": 256})
    spec["dataset"] = {**spec["dataset"], "text_column": "text", "label_column": "label"}
    answer = client.post("/v1/jobs?dry_run=true", json=spec, headers=keys.auth(keys.alice))
    assert answer.status_code == 200, answer.text
    body = answer.json()
    measured = body["preflight"]["sample_tokens"]
    timed = body["estimate"]["time"]
    assert timed["tokens_measured"] is True and timed["tokens_per_sample"] == round(measured["tokens"]) < 256
