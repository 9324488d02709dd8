"""``GET /metrics``: Prometheus text whose job figures follow the database as jobs move (SQLite, PostgreSQL)."""

from __future__ import annotations

from datetime import timedelta

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from api.main import create_app
from service_core.artifacts import ArtifactStore
from service_core.db import Job
from service_core.db.base import utcnow
from service_core.db.jobstore import transition
from service_core.db.session import make_engine
from service_core.retention import collect_garbage
from service_core.settings import Settings
from service_core.status import JobStatus
from tests.api.conftest import Keys, add_job, make_spec

pytestmark = pytest.mark.both_databases


def scrape(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    values = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return values


def jobs(values: dict[tuple[str, tuple[tuple[str, str], ...]], float], status: str) -> float:
    return values[("trainjobs_jobs", (("status", status),))]


def finished(values: dict[tuple[str, tuple[tuple[str, str], ...]], float], status: str) -> float:
    return values[("trainjobs_jobs_finished_total", (("status", status),))]


def test_job_figures_move_with_the_jobs(client: TestClient, session: Session) -> None:
    first = add_job(session, "alice", queue="gpu-24g")
    add_job(session, "alice", queue="gpu-24g")
    add_job(session, "bob", queue="default")
    before = scrape(client)
    assert jobs(before, "queued") == 3 and jobs(before, "running") == 0
    assert before[("trainjobs_queue_depth", (("queue", "gpu-24g"),))] == 2
    assert before[("trainjobs_queue_depth", (("queue", "default"),))] == 1

    assert transition(session, first.id, JobStatus.running, worker="slot-a@host")
    session.commit()
    running = scrape(client)
    assert jobs(running, "queued") == 2 and jobs(running, "running") == 1
    assert running[("trainjobs_queue_depth", (("queue", "gpu-24g"),))] == 1
    assert running[("trainjobs_worker_slots_busy", (("worker", "slot-a@host"),))] == 1

    # A 45 s run: lands in the 60 s bucket, not the 30 s one.
    assert transition(session, first.id, JobStatus.succeeded, started_at=utcnow() - timedelta(seconds=45))
    session.commit()
    done = scrape(client)
    assert jobs(done, "running") == 0 and finished(done, "succeeded") == 1
    assert ("trainjobs_worker_slots_busy", (("worker", "slot-a@host"),)) not in done
    assert done[("trainjobs_job_duration_seconds_count", ())] == 1
    assert done[("trainjobs_job_duration_seconds_bucket", (("le", "30.0"),))] == 0
    assert done[("trainjobs_job_duration_seconds_bucket", (("le", "60.0"),))] == 1
    assert 44 <= done[("trainjobs_job_duration_seconds_sum", ())] <= 60

    # Two more runs: 5 s and 2 h. Buckets are cumulative; the sum adds up.
    for seconds in (5, 2 * 3600):
        job = add_job(session, "bob")
        assert transition(session, job.id, JobStatus.running)
        assert transition(session, job.id, JobStatus.failed, started_at=utcnow() - timedelta(seconds=seconds))
    session.commit()
    later = scrape(client)
    bounds = ("10.0", "60.0", "3600.0", "14400.0", "+Inf")
    bucket = {le: later[("trainjobs_job_duration_seconds_bucket", (("le", le),))] for le in bounds}
    assert bucket == {"10.0": 1, "60.0": 2, "3600.0": 2, "14400.0": 3, "+Inf": 3}
    assert later[("trainjobs_job_duration_seconds_count", ())] == 3
    assert 2 * 3600 + 5 + 44 <= later[("trainjobs_job_duration_seconds_sum", ())] <= 2 * 3600 + 5 + 60
    assert finished(later, "succeeded") == 1 and finished(later, "failed") == 2


def test_request_latency_is_labelled_by_route_template(client: TestClient, session: Session, keys: Keys) -> None:
    job = add_job(session, "alice")
    for _ in range(3):
        assert client.get(f"/v1/jobs/{job.id}", headers=keys.auth(keys.alice)).status_code == 200
    assert client.get("/v1/jobs/nope", headers=keys.auth(keys.alice)).status_code == 404
    values = scrape(client)
    ok = ("trainjobs_http_request_duration_seconds_count",
          (("method", "GET"), ("route", "/v1/jobs/{job_id}"), ("status", "200")))  # fmt: skip
    missing = ("trainjobs_http_request_duration_seconds_count",
               (("method", "GET"), ("route", "/v1/jobs/{job_id}"), ("status", "404")))  # fmt: skip
    assert values[ok] == 3 and values[missing] == 1
    # Raw paths (job ids) never become labels: one series per route template.
    assert not any(job.id in str(labels) for _, labels in values)


def test_metrics_token_when_set_is_required(settings: Settings, keys: Keys) -> None:
    app = create_app(settings.model_copy(update={"metrics_token": "scrape-token-123"}))
    with TestClient(app) as client:
        assert client.get("/metrics").status_code == 401
        assert client.get("/metrics").headers["content-type"] == "application/problem+json"
        assert client.get("/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
        # An API key is not the scrape token.
        assert client.get("/metrics", headers=keys.auth(keys.admin)).status_code == 401
        scraped = client.get("/metrics", headers={"Authorization": "Bearer scrape-token-123"})
        assert scraped.status_code == 200 and "trainjobs_jobs" in scraped.text


def test_metrics_are_open_without_a_token(client: TestClient) -> None:
    assert client.get("/metrics").status_code == 200


def test_gauges_are_live_jobs_and_counters_count_every_finish(client: TestClient, session: Session, keys: Keys) -> None:
    submitted = [client.post("/v1/jobs", json=make_spec(), headers=keys.auth(keys.alice)) for _ in range(3)]
    assert [r.status_code for r in submitted] == [201, 201, 201]
    first, second, third = (r.json()["id"] for r in submitted)
    values = scrape(client)
    assert jobs(values, "queued") == 3 and jobs(values, "running") == 0
    # Terminal statuses are counters (below), not gauges of the rows that happen to be stored.
    assert {labels for name, labels in values if name == "trainjobs_jobs"} == {
        (("status", "queued"),),
        (("status", "running"),),
        (("status", "paused"),),
    }
    assert all(finished(values, s) == 0 for s in ("succeeded", "failed", "cancelled"))

    # Cancelled while queued: finished, but never ran, so no run time.
    assert client.post(f"/v1/jobs/{first}/cancel", headers=keys.auth(keys.alice)).status_code == 202
    # Requeued after a lost worker (running -> queued) and run again: one finish, not two.
    assert transition(session, second, JobStatus.running)
    assert transition(session, second, JobStatus.queued)
    assert transition(session, second, JobStatus.running)
    assert transition(session, second, JobStatus.succeeded, started_at=utcnow() - timedelta(seconds=20))
    assert transition(session, third, JobStatus.running)
    paused = add_job(session, "alice")
    assert transition(session, paused.id, JobStatus.paused)  # a paused job holds no slot
    session.commit()
    assert not transition(session, second, JobStatus.failed)  # terminal is final: counted once
    values = scrape(client)
    assert jobs(values, "queued") == 0 and jobs(values, "running") == 1 and jobs(values, "paused") == 1
    assert sum(v for (name, _), v in values.items() if name == "trainjobs_worker_slots_busy") == 1
    assert finished(values, "cancelled") == 1 and finished(values, "succeeded") == 1
    assert values[("trainjobs_job_duration_seconds_count", ())] == 1
    assert values[("trainjobs_job_duration_seconds_bucket", (("le", "30.0"),))] == 1


def test_gc_never_makes_a_counter_go_back(client: TestClient, session: Session, settings: Settings) -> None:
    for seconds in (5, 45, 400):
        job = add_job(session, "alice")
        assert transition(session, job.id, JobStatus.running)
        assert transition(session, job.id, JobStatus.failed, started_at=utcnow() - timedelta(seconds=seconds))
    running = add_job(session, "bob")
    assert transition(session, running.id, JobStatus.running)
    session.commit()
    before = scrape(client)

    engine = make_engine(settings.database_url)
    report = collect_garbage(sessionmaker(bind=engine), timedelta(days=90), now=utcnow() + timedelta(days=91),
                             artifacts=ArtifactStore(settings.artifacts_root))  # fmt: skip
    engine.dispose()
    assert report.jobs == 3  # every finished job is gone; the running one stays
    session.expire_all()
    assert session.scalar(select(func.count()).select_from(Job)) == 1

    after = scrape(client)
    assert finished(after, "failed") == finished(before, "failed") == 3
    assert jobs(after, "running") == jobs(before, "running") == 1
    for name in ("trainjobs_job_duration_seconds_count", "trainjobs_job_duration_seconds_sum"):
        assert after[(name, ())] == before[(name, ())]
    assert after[("trainjobs_job_duration_seconds_bucket", (("le", "60.0"),))] == 2
