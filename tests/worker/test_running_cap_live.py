"""The running-jobs cap with real parts: the API, two worker processes (two slots) and real training,
on PostgreSQL + Redis and on the embedded default. With a cap of 1, an owner's second job waits in the
queue (saying why) until its first ends, while another owner's job starts meanwhile."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service_core.db.session import session_scope
from service_core.keys import create_api_key

from .conftest import quick_spec
from .live import LiveService, start_worker
from .test_service_e2e import data_files, started_service, wait_status

pytestmark = pytest.mark.slow
FINISHED = {"succeeded", "failed", "cancelled"}


def wait_warmed_up(client: httpx.Client, timeout: float = 600) -> None:
    """Until the API has imported the training stack (a submit meanwhile may meet it half-imported on a
    loaded machine, see api/preflight.py)."""
    deadline = time.monotonic() + timeout
    while not client.get("/readyz").json().get("warmed_up"):
        assert time.monotonic() < deadline, "the API did not warm up"
        time.sleep(0.5)


@pytest.fixture(params=["embedded", "postgres-redis"])
def capped_service(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LiveService]:
    with started_service(request.param, tmp_path, TRAINJOBS_MAX_RUNNING_PER_OWNER="1") as live:
        start_worker(live)  # a second slot: room for two jobs at once
        yield live


def test_an_owners_second_job_waits_for_its_first_while_others_start(capped_service: LiveService) -> None:
    service = capped_service
    with session_scope(service.settings.database_url) as session:
        bob_key = create_api_key(session, "bob", settings=service.settings)
    files = data_files(service.settings)
    short = {**quick_spec(files), "queue": service.queue}
    bob = httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {bob_key}"}, timeout=120)
    with service.client(timeout=120) as alice, bob:
        wait_warmed_up(alice)
        # Long enough to outlast everything below; cancelled at the end.
        created = alice.post("/v1/jobs", json={**quick_spec(files, num_train_epochs=200), "queue": service.queue})
        assert created.status_code == 201, created.text
        long_id = created.json()["id"]
        wait_status(alice, long_id, {"running"}, timeout=120)
        second = alice.post("/v1/jobs", json=short)  # submitting over the cap is not refused
        bobs = bob.post("/v1/jobs", json=short)
        assert (second.status_code, bobs.status_code) == (201, 201), second.text + bobs.text
        second_id, bobs_id = second.json()["id"], bobs.json()["id"]

        bobs_job = wait_status(bob, bobs_id, FINISHED, timeout=180)  # ran on the free slot meanwhile
        assert bobs_job["status"] == "succeeded"
        held = alice.get(f"/v1/jobs/{second_id}").json()
        assert (held["status"], held["attempts"]) == ("queued", 0)
        assert "TRAINJOBS_MAX_RUNNING_PER_OWNER=1" in held["waiting"]
        assert alice.get(f"/v1/jobs/{long_id}").json()["status"] == "running"

        assert alice.post(f"/v1/jobs/{long_id}/cancel").status_code == 202
        first = wait_status(alice, long_id, FINISHED, timeout=120)
        ran = wait_status(alice, second_id, FINISHED, timeout=180)
    assert (first["status"], ran["status"], ran["waiting"]) == ("cancelled", "succeeded", None)
    assert ran["started_at"] >= first["finished_at"]  # never two of alice's jobs at once
    assert bobs_job["started_at"] < first["finished_at"]
