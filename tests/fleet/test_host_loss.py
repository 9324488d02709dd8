"""A worker host lost for good (every process SIGKILLed and its disk deleted) or cut off from the
network: its job goes on on the other worker host, from the newest checkpoint in the object store (or
from step 0 when there is none), with the step count of an uninterrupted run and one loss point a step.
A host that comes back after its job moved on writes nothing more: its writes are refused."""

from __future__ import annotations

import re
from typing import Any

import pytest

from service_core.status import ErrorReason
from tests.worker.test_service_e2e import poll_metrics
from worker.procfs import is_alive

from .netns import Host
from .stack import TERMINAL, Fleet, dataset_spec, wait_for

pytestmark = pytest.mark.slow
# 8 steps an epoch on the session's dataset. A job of 192 steps takes about a second on an idle machine
# and minutes on a loaded one: the tests that lose a host after a checkpoint hold the run at its first
# (Fleet.held_at_a_checkpoint), so the loss lands mid-run either way.
EPOCHS = 24
STEPS = EPOCHS * 8


def start_job(fleet: Fleet, queue: str, dataset_id: str, epochs: int = EPOCHS, **training: Any
              ) -> tuple[str, Host, Host]:  # fmt: skip
    """Both worker hosts up, one job submitted through the API host; returns it, the host that runs
    it and the other one, once it has trained a step."""
    fleet.start_workers(fleet.worker_hosts, queue)
    spec = dataset_spec(dataset_id, num_train_epochs=epochs, logging_steps=1, **training)
    with fleet.client() as client:
        created = client.post("/v1/jobs", json={**spec, "queue": queue})
    assert created.status_code == 201, created.text
    job_id: str = created.json()["id"]
    # Generous: a run's start takes a minute on a loaded 2-core machine, a second on an idle one.
    wait_for("the job to train a step", lambda: fleet.host_running(job_id) is not None
             and fleet.job(job_id).progress_step >= 1, timeout=240)  # fmt: skip
    running = fleet.host_running(job_id)
    assert running is not None
    other = next(host for host in fleet.worker_hosts if host is not running)
    return job_id, running, other


def finished_on(fleet: Fleet, job_id: str, host: Host, total: int = STEPS) -> None:
    """Wait for the job to end; check it succeeded on ``host`` in two attempts with all ``total`` steps
    trained and one loss point a step (none missing, none twice), as the API host serves them."""
    wait_for("the job to end", lambda: fleet.job(job_id).status in TERMINAL, timeout=300)
    job = fleet.job(job_id)
    assert (job.status, job.attempts, job.worker) == ("succeeded", 2, host.name), job.error_message
    assert job.progress_step == job.progress_total == total
    with fleet.client() as client:
        steps = [point["step"] for point in poll_metrics(client, job_id, 60) if point["name"] == "loss"]
    assert steps == list(range(1, total + 1))


def resumed_from(fleet: Fleet, job_id: str) -> int | None:
    """The checkpoint step the lost attempt's requeue named for the next attempt; None: from step 0."""
    requeues = [data for data in fleet.statuses(job_id) if data["status"] == "queued"]
    assert len(requeues) == 1, requeues
    assert requeues[0]["reason"] == ErrorReason.worker_lost
    message = str(requeues[0]["message"])
    if found := re.search(r"runs again from checkpoint-(\d+)", message):
        return int(found.group(1))
    assert "runs again from the start" in message, message
    return None


def test_a_host_lost_mid_job_resumes_on_the_other_host_from_the_store(
    fleet_stack: Fleet, queue: str, sentiment_dataset: str
) -> None:
    fleet = fleet_stack
    job_id, lost, other = start_job(fleet, queue, sentiment_dataset, save_steps=10)
    with fleet.held_at_a_checkpoint(job_id):
        wait_for("a checkpoint in the store", lambda: fleet.stored_checkpoints(job_id) != [], timeout=180)
        stored = fleet.stored_checkpoints(job_id)[-1]
        assert fleet.job(job_id).progress_step < STEPS
        lost.lose()

    finished_on(fleet, job_id, other)
    # The other host had nothing on its disk: it resumed from the store's checkpoint (or a newer one
    # whose upload was under way when the host was lost).
    assert (resumed_from(fleet, job_id) or 0) >= stored


def test_a_host_lost_before_its_first_checkpoint_restarts_from_step_0(
    fleet_stack: Fleet, queue: str, sentiment_dataset: str
) -> None:
    fleet = fleet_stack
    job_id, lost, other = start_job(fleet, queue, sentiment_dataset, epochs=6, save_steps=10_000)
    wait_for("a few steps", lambda: fleet.job(job_id).progress_step >= 3)
    lost.lose()

    finished_on(fleet, job_id, other, total=48)  # the lost attempt's points were dropped
    assert resumed_from(fleet, job_id) is None
    assert [m["attempt"] for m in fleet.manifests(job_id)] in ([], [2])  # at most the run's final save


def test_a_host_cut_off_past_its_lease_is_fenced_out_when_it_comes_back(
    fleet_stack: Fleet, queue: str, sentiment_dataset: str
) -> None:
    fleet = fleet_stack
    job_id, cut, other = start_job(fleet, queue, sentiment_dataset, save_steps=10)
    # Held while cut off, then going on: the stale run still trains when its host comes back.
    with fleet.held_at_a_checkpoint(job_id) as runs:
        wait_for("a checkpoint in the store", lambda: fleet.stored_checkpoints(job_id) != [], timeout=180)
        cut.cut()
        try:
            wait_for("the job to run on the other host",
                     lambda: fleet.host_running(job_id) is other and fleet.job(job_id).attempts == 2)  # fmt: skip
        finally:
            cut.reconnect()
    run = runs[cut.name]
    wait_for("the stale run to be killed", lambda: not is_alive(run), timeout=60)

    finished_on(fleet, job_id, other)
    assert [data["status"] for data in fleet.statuses(job_id)] == ["running", "queued", "running", "succeeded"]
    kind, last = fleet.events(job_id)[-1]
    assert (kind, last["status"]) == ("status", "succeeded")  # the stale attempt wrote nothing after it
    resumed = resumed_from(fleet, job_id)
    assert resumed is not None
    # No checkpoint past the one resumed from was committed by the fenced-out attempt.
    assert all(m["attempt"] == 2 for m in fleet.manifests(job_id) if m["step"] > resumed)
    assert "fenced out" in fleet.log(cut, f"worker-{queue}").read_text()
