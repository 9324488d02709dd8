"""Submit, show, list and cancel jobs; owner isolation on each."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from kombu import Connection
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.schemas.jobs import MAX_PRIORITY, MIN_PRIORITY
from service_core.db.models import Job, JobEvent
from service_core.settings import Settings
from service_core.status import ErrorReason, JobStatus
from tests.api.conftest import Keys, add_job, make_spec

pytestmark = pytest.mark.both_databases

# A BERT-large shape, config-built: far over the 1 GB test budget, and nothing to fetch from the hub
# (a hub id that is not cached is refused by preflight while HF_HUB_OFFLINE is set).
BERT_LARGE_CONFIG = {
    "model_type": "bert", "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
    "intermediate_size": 4096, "vocab_size": 30522,
}


def drain_broker(settings: Settings, queue: str) -> list[dict[str, Any]]:
    """Every message waiting on ``queue`` in the embedded broker: task name and args."""
    messages = []
    with Connection(settings.broker_url) as conn:
        simple = conn.SimpleQueue(queue)
        while True:
            try:
                message = simple.get(timeout=0.5)
            except simple.Empty:
                break
            messages.append({"task": message.headers["task"], "args": message.payload[0]})
            message.ack()
        simple.close()
    return messages


def test_submit_stores_estimates_and_enqueues(
    client: TestClient, keys: Keys, session: Session, settings: Settings
) -> None:
    response = client.post("/v1/jobs", json={**make_spec(), "priority": 3}, headers=keys.auth(keys.alice))
    assert response.status_code == 201, response.text
    body = response.json()
    assert body["status"] == "queued"
    assert body["owner"] == "alice"
    assert body["priority"] == 3
    assert body["queue"] == settings.default_queue
    assert response.headers["location"] == f"/v1/jobs/{body['id']}"
    assert body["links"]["events"] == f"/v1/jobs/{body['id']}/events"
    # the estimate is the estimator's, and its headline figures sit beside (not yet) measured ones
    assert body["estimate"]["total_bytes"] > body["estimate"]["optimizer_state_bytes"] > 0
    assert body["memory"]["estimated"]["optimizer_state_bytes"] == body["estimate"]["optimizer_state_bytes"]
    assert body["memory"]["measured"] is None
    # relative data paths are stored absolute under the data root
    assert body["spec"]["dataset"]["data_files"]["train"] == f"{settings.data_root.as_posix()}/reviews/train.csv"
    stored = session.get(Job, body["id"])
    assert stored is not None and stored.spec == body["spec"]
    # the row is its own outbox record: marked sent by the same INSERT (no second statement)
    assert stored.enqueued_at is not None and stored.enqueued_at == stored.created_at
    assert drain_broker(settings, settings.default_queue) == [{"task": "trainjobs.run_job", "args": [body["id"]]}]


def test_submit_routes_to_named_queue(client: TestClient, keys: Keys, settings: Settings) -> None:
    response = client.post("/v1/jobs", json={**make_spec(), "queue": "gpu-80g"}, headers=keys.auth(keys.alice))
    assert response.status_code == 201, response.text
    assert response.json()["queue"] == "gpu-80g"
    assert [m["args"] for m in drain_broker(settings, "gpu-80g")] == [[response.json()["id"]]]


def test_priority_scale_matches_the_worker() -> None:
    from service_core.queue import MAX_PRIORITY as WORKER_MAX
    from service_core.queue import MIN_PRIORITY as WORKER_MIN

    assert (MIN_PRIORITY, MAX_PRIORITY) == (WORKER_MIN, WORKER_MAX)


def test_submit_without_or_with_wrong_key_is_401(client: TestClient, keys: Keys, session: Session) -> None:
    missing = client.post("/v1/jobs", json=make_spec())
    wrong = client.post("/v1/jobs", json=make_spec(), headers=keys.auth("tj_not-a-key"))
    for response in (missing, wrong):
        assert response.status_code == 401
        assert response.headers["content-type"] == "application/problem+json"
        assert response.headers["www-authenticate"].startswith("Bearer")
    assert session.execute(select(func.count()).select_from(Job)).scalar_one() == 0


def test_over_budget_submit_is_refused_with_plan(
    client: TestClient, keys: Keys, session: Session, settings: Settings
) -> None:
    spec = make_spec(name="bert-large", model={"config": BERT_LARGE_CONFIG}, resources={"gpu_memory_gb": 1})
    response = client.post("/v1/jobs", json=spec, headers=keys.auth(keys.alice))
    assert response.status_code == 422, response.text
    problem = response.json()
    assert response.headers["content-type"] == "application/problem+json"
    assert problem["errors"][0]["field"] == "resources.gpu_memory_gb"
    assert problem["estimate"]["fits"] is False
    assert problem["estimate"]["total_bytes"] > problem["plan"]["budget_bytes"]
    assert problem["plan"]["minimum_total_bytes"] > 0 and "entries" in problem["plan"]
    assert session.execute(select(func.count()).select_from(Job)).scalar_one() == 0
    assert drain_broker(settings, settings.default_queue) == []


def test_queue_budget_applies_without_spec_budget(client: TestClient, keys: Keys, session: Session) -> None:
    spec = make_spec(name="bert-large", model={"config": BERT_LARGE_CONFIG})
    response = client.post("/v1/jobs", json={**spec, "queue": "gpu-1g"}, headers=keys.auth(keys.alice))
    assert response.status_code == 422, response.text
    assert response.json()["errors"][0]["field"] == "queue"
    assert session.execute(select(func.count()).select_from(Job)).scalar_one() == 0


def test_get_job_trio(client: TestClient, keys: Keys, session: Session) -> None:
    job = add_job(session, "alice", progress_step=5, progress_total=20, latest_metrics={"loss": 0.5})
    mine = client.get(f"/v1/jobs/{job.id}", headers=keys.auth(keys.alice))
    assert mine.status_code == 200
    assert mine.json()["progress"] == {"step": 5, "total": 20, "epoch": None, "fraction": 0.25}
    assert mine.json()["latest_metrics"] == {"loss": 0.5}
    assert client.get("/v1/jobs/nope", headers=keys.auth(keys.alice)).status_code == 404
    not_yours = client.get(f"/v1/jobs/{job.id}", headers=keys.auth(keys.bob))
    assert not_yours.status_code == 404
    assert not_yours.headers["content-type"] == "application/problem+json"
    assert client.get(f"/v1/jobs/{job.id}", headers=keys.auth(keys.admin)).status_code == 200
    assert client.get(f"/v1/jobs/{job.id}").status_code == 401


def test_failed_job_shows_reason_and_memory_side_by_side(client: TestClient, keys: Keys, session: Session) -> None:
    job = add_job(
        session,
        "alice",
        JobStatus.failed,
        error_reason="out_of_memory",
        error_message="CUDA out of memory",
        estimate={"optimizer_state_bytes": 800, "total_bytes": 5000, "parts": []},
        measured_memory={"optimizer_state_bytes": 800, "peak_allocated_bytes": 6000},
    )
    body = client.get(f"/v1/jobs/{job.id}", headers=keys.auth(keys.alice)).json()
    assert body["error"] == {"reason": "out_of_memory", "message": "CUDA out of memory"}
    assert body["memory"] == {
        "estimated": {"optimizer_state_bytes": 800, "total_bytes": 5000},
        "measured": {"optimizer_state_bytes": 800, "peak_allocated_bytes": 6000},
    }


def test_list_is_owned_newest_first_and_pages(client: TestClient, keys: Keys, session: Session) -> None:
    mine = [add_job(session, "alice", name=f"a{i}") for i in range(5)]
    add_job(session, "bob", name="b0")
    seen: list[str] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": 2} | ({"cursor": cursor} if cursor else {})
        page = client.get("/v1/jobs", params=params, headers=keys.auth(keys.alice)).json()
        seen += [item["id"] for item in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    newest_first = sorted(mine, key=lambda j: (j.created_at, j.id), reverse=True)
    assert seen == [j.id for j in newest_first]
    everyone = client.get("/v1/jobs", headers=keys.auth(keys.admin)).json()["items"]
    assert len(everyone) == 6
    assert client.get("/v1/jobs", headers=keys.auth(keys.bob)).json()["items"][0]["name"] == "b0"


def test_list_filters_by_owner_for_admins_only(client: TestClient, keys: Keys, session: Session) -> None:
    add_job(session, "alice", name="a0")
    add_job(session, "bob", name="b0")
    add_job(session, "bob", name="b1")

    def names(key: str, **params: Any) -> list[str]:
        response = client.get("/v1/jobs", params=params, headers=keys.auth(key))
        assert response.status_code == 200, response.text
        return sorted(j["name"] for j in response.json()["items"])

    assert names(keys.admin, owner="bob") == ["b0", "b1"]
    assert names(keys.admin, owner="nobody") == []
    assert names(keys.admin) == ["a0", "b0", "b1"]
    assert names(keys.alice, owner="alice") == ["a0"]
    refused = client.get("/v1/jobs", params={"owner": "bob"}, headers=keys.auth(keys.alice))
    assert refused.status_code == 403
    assert refused.headers["content-type"] == "application/problem+json"
    assert refused.json()["errors"][0]["field"] == "owner"


def test_list_filters_by_status_and_rejects_bad_input(client: TestClient, keys: Keys, session: Session) -> None:
    add_job(session, "alice", JobStatus.running, name="run")
    add_job(session, "alice", JobStatus.queued, name="wait")
    running = client.get("/v1/jobs", params={"status": "running"}, headers=keys.auth(keys.alice)).json()
    assert [j["name"] for j in running["items"]] == ["run"]
    bad_status = client.get("/v1/jobs", params={"status": "sleeping"}, headers=keys.auth(keys.alice))
    assert bad_status.status_code == 422 and bad_status.json()["errors"][0]["field"] == "status"
    bad_cursor = client.get("/v1/jobs", params={"cursor": "!!"}, headers=keys.auth(keys.alice))
    assert bad_cursor.status_code == 422 and bad_cursor.json()["errors"][0]["field"] == "cursor"


def test_cancel_queued_job_at_once(client: TestClient, keys: Keys, session: Session) -> None:
    job = add_job(session, "alice")
    response = client.post(f"/v1/jobs/{job.id}/cancel", headers=keys.auth(keys.alice))
    assert response.status_code == 202
    assert response.json()["status"] == "cancelled"
    assert response.json()["finished_at"] is not None
    # The same reason as a running job's cancel (tests/worker/test_supervisor.py, test_service_e2e.py).
    assert response.json()["error"]["reason"] == ErrorReason.cancelled
    event = session.execute(select(JobEvent).where(JobEvent.job_id == job.id)).scalar_one()
    assert (event.kind, event.data["status"], event.data["previous"]) == ("status", "cancelled", "queued")
    assert event.data["reason"] == ErrorReason.cancelled


def test_cancel_running_job_asks_the_worker(client: TestClient, keys: Keys, session: Session) -> None:
    job = add_job(session, "alice", JobStatus.running)
    response = client.post(f"/v1/jobs/{job.id}/cancel", headers=keys.auth(keys.alice))
    assert response.status_code == 202
    assert response.json()["status"] == "running"
    assert response.json()["cancel_requested"] is True
    session.expire_all()
    assert session.get(Job, job.id).cancel_requested is True  # type: ignore[union-attr]


def test_cancel_finished_job_is_409(client: TestClient, keys: Keys, session: Session) -> None:
    job = add_job(session, "alice", JobStatus.succeeded)
    response = client.post(f"/v1/jobs/{job.id}/cancel", headers=keys.auth(keys.alice))
    assert response.status_code == 409
    assert response.json()["job_status"] == "succeeded"


def test_cancel_not_found_and_not_yours(client: TestClient, keys: Keys, session: Session) -> None:
    job = add_job(session, "alice")
    assert client.post("/v1/jobs/nope/cancel", headers=keys.auth(keys.alice)).status_code == 404
    assert client.post(f"/v1/jobs/{job.id}/cancel", headers=keys.auth(keys.bob)).status_code == 404
    assert client.post(f"/v1/jobs/{job.id}/cancel").status_code == 401
    session.expire_all()
    assert session.get(Job, job.id).status == "queued"  # type: ignore[union-attr]


def test_unreachable_broker_fails_the_job_visibly(settings: Settings, keys: Keys, session: Session) -> None:
    from api.main import create_app

    down = settings.model_copy(update={"broker_url_": "redis://127.0.0.1:1/0"})
    with TestClient(create_app(down)) as test_client:
        response = test_client.post("/v1/jobs", json=make_spec(), headers=keys.auth(keys.alice))
    assert response.status_code == 503
    assert response.headers["content-type"] == "application/problem+json"
    job = session.execute(select(Job)).scalar_one()
    assert (job.status, job.error_reason) == ("failed", ErrorReason.internal)
    assert job.error_message is not None and job.error_message.startswith("the queue could not take the job:")


def test_a_stored_reason_outside_the_vocabulary_is_shown_as_internal(
    client: TestClient, keys: Keys, session: Session
) -> None:
    # e.g. "cancel", which a running job's cancel was stored as before the vocabulary had one name for it
    job = add_job(session, "alice", JobStatus.cancelled, error_reason="cancel", error_message="cancelled by alice")
    body = client.get(f"/v1/jobs/{job.id}", headers=keys.auth(keys.alice)).json()
    assert body["error"] == {"reason": ErrorReason.internal, "message": "cancelled by alice"}
    assert client.get("/v1/jobs", headers=keys.auth(keys.alice)).status_code == 200


def test_openapi_lists_the_status_and_reason_vocabulary(client: TestClient) -> None:
    schemas = client.get("/openapi.json").json()["components"]["schemas"]
    assert schemas["JobOut"]["properties"]["status"] == {"$ref": "#/components/schemas/JobStatus"}
    assert {"$ref": "#/components/schemas/ErrorReason"} in schemas["JobError"]["properties"]["reason"]["anyOf"]
    assert schemas["JobStatus"]["enum"] == [s.value for s in JobStatus]
    assert schemas["ErrorReason"]["enum"] == [r.value for r in ErrorReason]


def test_over_budget_advice_is_true_when_nothing_fits(client: TestClient, keys: Keys, session: Session) -> None:
    spec = make_spec(name="bert-large", model={"config": BERT_LARGE_CONFIG}, resources={"gpu_memory_gb": 0.01})
    response = client.post("/v1/jobs", json=spec, headers=keys.auth(keys.alice))
    assert response.status_code == 422, response.text
    problem = response.json()
    assert problem["plan"]["entries"] == []
    assert "`plan` lists" not in problem["detail"]  # no promise of a plan it does not have
    assert "nothing the planner tried fits" in problem["detail"]
    smallest = problem["plan"]["minimum_total_bytes"] / (1 << 30)
    assert f"smallest footprint found is {smallest:.2f} GiB with " in problem["detail"]
    assert all(f"{k}={v}" in problem["detail"] for k, v in problem["plan"]["minimum_changes"].items())
    assert session.execute(select(func.count()).select_from(Job)).scalar_one() == 0


def test_over_budget_advice_names_the_first_entry_that_fits(client: TestClient, keys: Keys) -> None:
    spec = make_spec(name="bert-large", model={"config": BERT_LARGE_CONFIG}, resources={"gpu_memory_gb": 4})
    response = client.post("/v1/jobs", json=spec, headers=keys.auth(keys.alice))
    assert response.status_code == 422, response.text
    problem = response.json()
    entries = problem["plan"]["entries"]
    assert entries and f"`plan` lists {len(entries)} configuration(s) that fit" in problem["detail"]
    assert all(f"{k}={v}" in problem["detail"] for k, v in entries[0]["changes"].items())


def test_job_detail_lists_its_out_of_memory_retries(client: TestClient, keys: Keys, session: Session) -> None:
    from service_core.db.jobstore import add_events

    job = add_job(session, "alice")
    retry = {"reason": "out_of_memory", "attempt": 1, "micro_batch": 8,
             "changes": {"training.per_device_train_batch_size": 4, "efficiency.gradient_accumulation_steps": 2}}
    add_events(session, job.id, [("retry", retry, None), ("log", {"message": "not a retry"}, None)])
    session.commit()
    body = client.get(f"/v1/jobs/{job.id}", headers=keys.auth(keys.alice)).json()
    assert body["retries"] == [retry]
    listed = client.get("/v1/jobs", headers=keys.auth(keys.alice)).json()["items"]
    assert listed[0]["retries"] == []  # the list stays one query; the detail has them
