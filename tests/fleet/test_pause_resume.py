"""Pause and resume across hosts (PostgreSQL, Redis, the object store): a job paused on one worker host
resumes on the other, whose disk never held it, from the checkpoint its pause stored, and draws the
loss curve of an uninterrupted run exactly."""

from __future__ import annotations

from typing import Any

import pytest

from tests.worker.test_service_e2e import poll_metrics

from .stack import TERMINAL, Fleet, dataset_spec, wait_for

pytestmark = pytest.mark.slow

# 8 steps an epoch on the 64 uploaded rows, 160 steps; the first checkpoint (step 10) is where the
# paused job's run is held until its slot stops it, so the pause lands mid-run however fast the machine.
LONG = {"num_train_epochs": 20, "logging_steps": 1, "seed": 7, "save_steps": 10}


def losses(fleet: Fleet, job_id: str) -> list[tuple[int, float]]:
    with fleet.client() as client:
        return [(p["step"], p["value"]) for p in poll_metrics(client, job_id, 60) if p["name"] == "loss"]


def submit(fleet: Fleet, spec: dict[str, Any]) -> str:
    with fleet.client() as client:
        created = client.post("/v1/jobs", json=spec)
    assert created.status_code == 201, created.text
    return str(created.json()["id"])


def test_a_job_paused_on_one_host_resumes_on_the_other_with_the_exact_curve(
    fleet_stack: Fleet, queue: str, sentiment_dataset: str
) -> None:
    fleet = fleet_stack
    first, second = fleet.worker_hosts
    spec = {**dataset_spec(sentiment_dataset, **LONG), "queue": queue}
    fleet.start_workers([first], queue)
    paused = submit(fleet, spec)
    with fleet.held_at_a_checkpoint(paused), fleet.client() as client:
        assert client.post(f"/v1/jobs/{paused}/pause").status_code == 202
        wait_for("the slot to stop the held run", lambda: fleet.stop_asked(paused), timeout=60)
    wait_for("the pause", lambda: fleet.job(paused).status == "paused", timeout=120)
    stopped_at = fleet.job(paused).progress_step
    assert stopped_at in fleet.stored_checkpoints(paused)  # its pause's checkpoint, in the store

    straight = submit(fleet, spec)  # the slot is free: the same spec, uninterrupted
    wait_for("the uninterrupted run", lambda: fleet.job(straight).status in TERMINAL, timeout=240)
    assert fleet.job(straight).status == "succeeded", fleet.job(straight).error_message

    fleet.stop_workers(queue)  # the first host's processes and disk are gone
    fleet.start_workers([second], queue)
    with fleet.client() as client:
        assert client.post(f"/v1/jobs/{paused}/resume").json()["status"] == "queued"
    wait_for("the resumed run", lambda: fleet.job(paused).status in TERMINAL, timeout=240)
    job = fleet.job(paused)
    assert (job.status, job.attempts, job.worker) == ("succeeded", 2, second.name), job.error_message
    reference, curve = losses(fleet, straight), losses(fleet, paused)
    assert [step for step, _ in curve] == [step for step, _ in reference] == list(range(1, job.progress_total + 1))
    assert stopped_at < job.progress_total
    assert [loss for _, loss in curve] == pytest.approx([loss for _, loss in reference], rel=1e-5)
