"""Cost and usage (issue 29): every attempt charged, the queue's price at submit, ``GET /v1/usage`` sums by
owner, queue and day on both database shapes, the predicted cost of an estimate, and the monthly
device-hour budget's 429."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session

from api.main import create_app
from service_core.db.jobstore import transition
from service_core.db.models import Job, JobEvent
from service_core.settings import Settings
from service_core.status import JobStatus
from service_core.usage import month_start
from tests.api.conftest import Keys, add_job, make_spec


def status_times(db: Session, job_id: str) -> list[tuple[str, datetime]]:
    events = db.scalars(
        select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.kind == "status").order_by(JobEvent.seq)
    )
    return [(e.data["status"], e.time) for e in events]


@pytest.mark.both_databases
def test_every_attempt_is_charged_at_the_price_of_its_submit(app: Any, client: TestClient, keys: Keys) -> None:
    with app.state.sessionmaker() as db:
        job = add_job(db, "alice", devices=2, price_per_device_hour=3.0)
        # Two attempts, as a requeue after a lost host makes them: running, queued, running, succeeded.
        for new in (JobStatus.running, JobStatus.queued, JobStatus.running, JobStatus.succeeded):
            assert transition(db, job.id, new)
            db.commit()
            time.sleep(0.15)
        moves = status_times(db, job.id)
    assert [s for s, _ in moves] == ["running", "queued", "running", "succeeded"]
    attempts = (moves[1][1] - moves[0][1]) + (moves[3][1] - moves[2][1])
    usage = client.get(f"/v1/jobs/{job.id}", headers=keys.auth(keys.alice)).json()["usage"]
    # Both attempts (started_at holds the second's start only), on both devices, at 3.0 a device-hour.
    assert usage["run_seconds"] == pytest.approx(attempts.total_seconds(), abs=1e-6)
    assert usage["run_seconds"] > 0.29
    assert usage["device_hours"] == pytest.approx(usage["run_seconds"] * 2 / 3600)
    assert usage["cost"] == pytest.approx(usage["device_hours"] * 3.0)
    assert (usage["devices"], usage["price_per_device_hour"], usage["predicted_device_hours"]) == (2, 3.0, None)


def test_a_running_job_is_charged_up_to_now(app: Any, client: TestClient, keys: Keys) -> None:
    with app.state.sessionmaker() as db:
        job = add_job(db, "alice")
        assert transition(db, job.id, JobStatus.running)
        db.commit()
    time.sleep(0.2)
    first = client.get(f"/v1/jobs/{job.id}", headers=keys.auth(keys.alice)).json()["usage"]
    time.sleep(0.2)
    second = client.get(f"/v1/jobs/{job.id}", headers=keys.auth(keys.alice)).json()["usage"]
    assert 0.2 <= first["run_seconds"] < second["run_seconds"]
    assert first["cost"] is None  # the default queue has no price


NOW = datetime.now(UTC)
DAY1 = (NOW - timedelta(days=2)).replace(hour=10, minute=0, second=0, microsecond=0)
DAY2 = DAY1 + timedelta(days=1)


def finished_job(db: Session, owner: str, queue: str, at: datetime, seconds: float, devices: int = 1,
                 price: float | None = None, status: JobStatus = JobStatus.succeeded) -> None:  # fmt: skip
    add_job(db, owner, status, queue=queue, started_at=at - timedelta(seconds=seconds), finished_at=at,
            run_seconds=seconds, devices=devices, price_per_device_hour=price)  # fmt: skip


@pytest.fixture
def history(app: Any) -> None:
    with app.state.sessionmaker() as db:
        finished_job(db, "alice", "gpu", DAY1, 3600, devices=2, price=2.0)  # 2 device-hours, cost 4
        finished_job(db, "alice", "cpu", DAY2, 1800, status=JobStatus.failed)  # 0.5, no price
        finished_job(db, "bob", "gpu", DAY2, 7200, price=2.0)  # 2, cost 4
        finished_job(db, "bob", "gpu", DAY2, 360, price=5.0, status=JobStatus.cancelled)  # 0.1 at 5.0: 0.5
        finished_job(db, "bob", "gpu", DAY1 - timedelta(days=30), 3600, price=2.0)  # before the period
        add_job(db, "bob", JobStatus.running, queue="gpu", started_at=NOW)  # not finished: not counted yet


def usage(client: TestClient, key: str, status: int = 200, **params: Any) -> dict[str, Any]:
    params.setdefault("from", (DAY1 - timedelta(days=1)).isoformat())
    response = client.get("/v1/usage", params=params, headers={"Authorization": f"Bearer {key}"})
    assert response.status_code == status, response.text
    body: dict[str, Any] = response.json()
    return body


def by_key(body: dict[str, Any]) -> dict[str, tuple[float, float | None, dict[str, int]]]:
    return {
        g["key"]: (round(g["device_hours"], 9), g["cost"] and round(g["cost"], 9), g["jobs"]) for g in body["groups"]
    }


@pytest.mark.both_databases
def test_usage_sums_device_hours_cost_and_final_statuses(client: TestClient, keys: Keys, history: None) -> None:
    owners = usage(client, keys.admin, group_by="owner")
    assert by_key(owners) == {
        "alice": (2.5, 4.0, {"succeeded": 1, "failed": 1}),
        "bob": (2.1, 4.5, {"succeeded": 1, "cancelled": 1}),
    }
    assert (round(owners["total"]["device_hours"], 9), owners["total"]["cost"]) == (4.6, pytest.approx(8.5))
    assert owners["owner"] is None and owners["from"].startswith((DAY1 - timedelta(days=1)).date().isoformat())
    assert by_key(usage(client, keys.admin, group_by="queue")) == {
        "cpu": (0.5, None, {"failed": 1}),
        "gpu": (4.1, 8.5, {"succeeded": 2, "cancelled": 1}),
    }
    assert by_key(usage(client, keys.admin, group_by="day")) == {
        DAY1.date().isoformat(): (2.0, 4.0, {"succeeded": 1}),
        DAY2.date().isoformat(): (2.6, 4.5, {"succeeded": 1, "failed": 1, "cancelled": 1}),
    }
    # A user sees its own; an admin may ask for one owner.
    mine = usage(client, keys.alice, group_by="queue")
    assert mine["owner"] == "alice" and by_key(mine) == {
        "cpu": (0.5, None, {"failed": 1}),
        "gpu": (2.0, 4.0, {"succeeded": 1}),
    }
    assert usage(client, keys.admin, group_by="owner", owner="bob")["total"]["device_hours"] == pytest.approx(2.1)
    # The period: `to` is exclusive, and ends after it starts.
    assert usage(client, keys.admin, to=DAY2.isoformat())["total"]["device_hours"] == pytest.approx(2.0)


def test_usage_refuses_another_owner_and_an_empty_period(client: TestClient, keys: Keys) -> None:
    refused = usage(client, keys.alice, status=403, owner="bob")
    assert refused["errors"][0]["field"] == "owner"
    backwards = usage(client, keys.alice, status=422, **{"from": DAY2.isoformat(), "to": DAY1.isoformat()})
    assert backwards["errors"][0]["field"] == "to"
    bad = usage(client, keys.alice, status=422, group_by="week")
    assert "group_by" in str(bad["errors"])


@pytest.fixture
def priced(settings: Settings) -> Settings:
    """A device to time jobs on, and a price for the default queue."""
    return settings.model_copy(update={"queue_devices": {"default": "A100-80GB"}, "queue_prices": {"default": 2.0}})


def test_the_estimate_prices_the_predicted_time(priced: Settings, keys: Keys) -> None:
    spec = make_spec(resources={"num_processes": 2})
    with TestClient(create_app(priced)) as client:
        response = client.post("/v1/jobs?dry_run=true", json=spec, headers=keys.auth(keys.alice))
    assert response.status_code == 200, response.text
    timed = response.json()["estimate"]["time"]
    assert timed["devices"] == 2 and timed["price_per_device_hour"] == 2.0
    assert timed["device_hours"] == pytest.approx(timed["seconds"] * 2 / 3600)
    assert timed["cost"] == pytest.approx(timed["device_hours"] * 2.0)


def test_a_submit_over_the_monthly_budget_is_a_429_naming_it(priced: Settings, keys: Keys) -> None:
    settings = priced.model_copy(update={"owner_monthly_device_hours": {"alice": 1.0}})
    app = create_app(settings)
    with app.state.sessionmaker() as db:
        # This month: 0.9 device-hours spent; last month's hours do not count.
        finished_job(db, "alice", "default", NOW, 0.9 * 3600)
        finished_job(db, "alice", "default", month_start(NOW) - timedelta(hours=1), 50 * 3600)
    with TestClient(app) as client:
        small = client.post("/v1/jobs", json=make_spec(), headers=keys.auth(keys.alice))
        assert small.status_code == 201, small.text
        predicted = small.json()["usage"]["predicted_device_hours"]
        assert 0 < predicted < 0.1
        with app.state.sessionmaker() as db:
            # Another 0.1 - predicted spent leaves less than this job's prediction (the queued one reserves its own).
            finished_job(db, "alice", "default", NOW, (0.1 - predicted) * 3600 - 1e-6)
        over = client.post("/v1/jobs", json=make_spec(), headers=keys.auth(keys.alice))
        assert over.status_code == 429, over.text
        problem = over.json()
        assert problem["errors"][0]["field"] == "budget" and "TRAINJOBS_OWNER_MONTHLY_DEVICE_HOURS" in problem["detail"]
        assert problem["budget_device_hours"] == 1.0
        assert problem["predicted_device_hours"] == pytest.approx(predicted)
        assert problem["left_device_hours"] < predicted
        # The dry run says the same; bob has no budget.
        assert client.post("/v1/jobs?dry_run=true", json=make_spec(), headers=keys.auth(keys.alice)).status_code == 429
        assert client.post("/v1/jobs", json=make_spec(), headers=keys.auth(keys.bob)).status_code == 201
    with app.state.sessionmaker() as db:
        assert db.scalar(select(Job.id).where(Job.owner == "alice", Job.status == "queued")) == small.json()["id"]


def test_budget_and_price_settings_read_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAINJOBS_OWNER_MONTHLY_DEVICE_HOURS", "12")
    monkeypatch.setenv("TRAINJOBS_QUEUE_PRICES", '{"gpu-80g": 2.5}')
    read = Settings()
    assert read.owner_monthly_device_hours == {"*": 12.0} and read.queue_prices == {"gpu-80g": 2.5}
    monkeypatch.setenv("TRAINJOBS_QUEUE_PRICES", '{"gpu-80g": -1}')
    with pytest.raises(ValidationError, match="gpu-80g"):
        Settings()
