"""Pause and resume through the live service (API + one worker slot + real training runs).

A running job paused mid-run checkpoints, frees its slot (another job trains meanwhile) and becomes
``paused``; resumed, it continues from that checkpoint and draws the very loss curve of an
uninterrupted run of the same spec. A pause and a cancel fired at once end in ``cancelled``.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest

from tests.trainjobs.conftest import job_spec
from tests.trainjobs.live import LiveService
from trainjobs.client import Client

pytestmark = pytest.mark.slow

# 6 steps an epoch on 96 rows: 150 steps of ~20 ms leave seconds to pause in mid-run.
LONG = {"num_train_epochs": 25, "logging_steps": 1, "eval_strategy": "no", "seed": 7}


def wait_for(client: Client, job_id: str, done: Any, timeout: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    job = client.get(job_id)
    while not done(job):
        assert time.monotonic() < deadline, job
        time.sleep(0.2)
        job = client.get(job_id)
    return job


def losses(client: Client, job_id: str) -> list[tuple[int, float]]:
    return [(p["step"], p["value"]) for p in client.metrics(job_id, name="loss")]


def fire_at_once(service: LiveService, job_id: str, actions: tuple[str, ...]) -> dict[str, int]:
    """POST each action to the job from its own thread, released together; the status code of each."""
    answers: dict[str, int] = {}
    start = threading.Barrier(len(actions))

    def fire(action: str) -> None:
        with httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {service.key}"}) as http:
            start.wait()
            answers[action] = http.post(f"/v1/jobs/{job_id}/{action}").status_code

    threads = [threading.Thread(target=fire, args=(action,)) for action in actions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return answers


def test_a_paused_job_frees_its_slot_and_resumes_with_the_exact_curve(
    service: LiveService, sentiment_files: dict[str, str]
) -> None:
    client = Client(service.url, service.key, timeout=60)
    paused_id = client.submit(job_spec(sentiment_files, "paused-run", training=LONG))["id"]
    wait_for(client, paused_id, lambda j: j["status"] == "running" and j["progress"]["step"] >= 20)
    asked = client.pause(paused_id)
    assert asked["status"] in ("running", "paused")
    job = wait_for(client, paused_id, lambda j: j["status"] == "paused", timeout=60)
    stopped_at, total = job["progress"]["step"], job["progress"]["total"]
    assert 20 <= stopped_at < total and job["pause_requested"] is False and job["finished_at"] is None

    # The slot is free: a second job (the same spec, uninterrupted) trains to the end meanwhile.
    straight_id = client.submit(job_spec(sentiment_files, "straight-run", training=LONG))["id"]
    straight = wait_for(client, straight_id, lambda j: j["finished_at"] is not None)
    assert straight["status"] == "succeeded", straight["error"]
    assert client.get(paused_id)["status"] == "paused"

    assert client.resume(paused_id)["status"] == "queued"
    resumed = wait_for(client, paused_id, lambda j: j["finished_at"] is not None)
    assert (resumed["status"], resumed["attempts"]) == ("succeeded", 2), resumed["error"]
    assert resumed["usage"]["run_seconds"] > 0

    reference, curve = losses(client, straight_id), losses(client, paused_id)
    assert [step for step, _ in curve] == [step for step, _ in reference] == list(range(1, total + 1))
    # The same steps, data, schedule and optimizer state: the same losses.
    assert [loss for _, loss in curve] == pytest.approx([loss for _, loss in reference], rel=1e-5)


def test_pause_and_cancel_fired_at_once_end_cancelled(service: LiveService, sentiment_files: dict[str, str]) -> None:
    client = Client(service.url, service.key, timeout=60)
    running_id = client.submit(job_spec(sentiment_files, "race-running", training=LONG))["id"]
    wait_for(client, running_id, lambda j: j["status"] == "running" and j["progress"]["step"] >= 5)
    queued_id = client.submit(job_spec(sentiment_files, "race-queued", training=LONG))["id"]  # behind it: one slot

    for job_id in (queued_id, running_id):
        answers = fire_at_once(service, job_id, ("pause", "cancel"))
        assert answers["cancel"] == 202 and answers["pause"] in (202, 409), answers
    for job_id in (queued_id, running_id):
        job = wait_for(client, job_id, lambda j: j["finished_at"] is not None, timeout=60)
        assert (job["status"], job["error"]["reason"]) == ("cancelled", "cancelled")
