"""``GET /v1/jobs/{id}/metrics?max_points=``: each series thinned by min/max buckets, spikes kept."""

from __future__ import annotations

import math

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from api.routes.metrics import min_max_indices
from service_core.db.models import MetricPoint
from service_core.db.session import allocate_seqs
from tests.api.conftest import Keys, add_job

pytestmark = pytest.mark.both_databases

SPIKE_STEP = 3217


def add_series(session: Session, job_id: str, steps: int) -> None:
    """Like the worker: one seq per logging step, loss and learning rate at each; one loss spike."""
    first = allocate_seqs(session, job_id, steps)
    rows = []
    for i in range(steps):
        step = i + 1
        loss = 50.0 if step == SPIKE_STEP else 1.0 + 0.1 * math.sin(step / 50)
        rows += [
            {"job_id": job_id, "seq": first + i, "step": step, "name": "loss", "value": loss},
            {"job_id": job_id, "seq": first + i, "step": step, "name": "learning_rate", "value": 1e-3 / step},
        ]
    session.execute(MetricPoint.__table__.insert(), rows)
    session.commit()


def test_thinned_series_keep_the_spike_and_stay_within_max_points(
    client: TestClient, keys: Keys, session: Session
) -> None:
    job = add_job(session, "alice")
    add_series(session, job.id, steps=10_000)
    response = client.get(f"/v1/jobs/{job.id}/metrics", params={"max_points": 500}, headers=keys.auth(keys.alice))
    assert response.status_code == 200, response.text
    body = response.json()
    loss = [p for p in body["items"] if p["name"] == "loss"]
    rate = [p for p in body["items"] if p["name"] == "learning_rate"]
    assert 400 <= len(loss) <= 500 and 400 <= len(rate) <= 500
    assert max(p["value"] for p in loss) == 50.0 and any(p["step"] == SPIKE_STEP for p in loss)
    assert loss[0]["step"] == 1 and loss[-1]["step"] == 10_000  # both ends kept
    assert [p["step"] for p in loss] == sorted(p["step"] for p in loss)
    assert body["next_after"] == 10_000 and body["has_more"] is False


def test_thinning_one_name_and_appending_after(client: TestClient, keys: Keys, session: Session) -> None:
    job = add_job(session, "alice")
    add_series(session, job.id, steps=50)
    params: dict[str, int | str] = {"max_points": 1000, "name": "loss"}
    body = client.get(f"/v1/jobs/{job.id}/metrics", params=params, headers=keys.auth(keys.alice)).json()
    # Fewer points than max_points: every one, unchanged, and only the named series.
    assert [p["step"] for p in body["items"]] == list(range(1, 51))
    assert {p["name"] for p in body["items"]} == {"loss"}
    add_series(session, job.id, steps=3)
    newer = client.get(
        f"/v1/jobs/{job.id}/metrics", params={"after": body["next_after"]}, headers=keys.auth(keys.alice)
    )
    assert [p["seq"] for p in newer.json()["items"]] == [51, 51, 52, 52, 53, 53]


def test_thinning_not_found_not_yours_and_bad_max_points(client: TestClient, keys: Keys, session: Session) -> None:
    job = add_job(session, "alice")
    params = {"max_points": 100}
    assert client.get("/v1/jobs/nope/metrics", params=params, headers=keys.auth(keys.alice)).status_code == 404
    assert client.get(f"/v1/jobs/{job.id}/metrics", params=params, headers=keys.auth(keys.bob)).status_code == 404
    bad = client.get(f"/v1/jobs/{job.id}/metrics", params={"max_points": 2}, headers=keys.auth(keys.alice))
    assert bad.status_code == 422 and bad.json()["errors"][0]["field"] == "max_points"


def test_min_max_buckets_keep_both_extremes_in_order() -> None:
    values: list[float | None] = [5, 1, 9, 5, 5, 5, -3, 5, 5, 5, 5, 7]
    kept = min_max_indices(values, 6)
    assert len(kept) <= 6 and kept == sorted(kept)
    assert kept[0] == 0 and kept[-1] == len(values) - 1
    assert 6 in kept and 2 in kept  # the -3 and the 9
    gaps: list[float | None] = [None] * 20
    assert len(min_max_indices(gaps, 6)) <= 6
    mixed: list[float | None] = [1.0, None, None, 8.0, None, 2.0, None, None, 0.5, 3.0]
    assert {3, 8} <= set(min_max_indices(mixed, 6))
