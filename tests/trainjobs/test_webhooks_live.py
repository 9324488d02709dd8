"""Webhooks through the real service: ``trainjobs serve`` and ``trainjobs worker`` processes (the worker
sends the deliveries), the ``trainjobs webhooks`` commands, and a real job whose events reach a receiver
that is down while the job runs and while the API process is killed and restarted, then comes back.

A service of its own (the shared one in conftest.py refuses loopback webhook URLs, as a deployment
does): TRAINJOBS_ALLOW_PRIVATE_TARGETS lets it reach the receiver on 127.0.0.1, and the retry backoff
is scaled down (TRAINJOBS_WEBHOOK_BACKOFF_SECONDS=0.5) so the outage costs seconds, not minutes.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.trainer_core.datagen import write_sentiment_csv
from tests.trainjobs.conftest import job_spec
from tests.trainjobs.live import LiveService
from tests.worker.test_webhooks import Receiver
from trainjobs.client import Client


@pytest.fixture(scope="module")
def hooked_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveService]:
    live = LiveService(tmp_path_factory.mktemp("webhooks"))
    live.env.update({
        "TRAINJOBS_ALLOW_PRIVATE_TARGETS": "true",
        "TRAINJOBS_WEBHOOK_POLL_SECONDS": "0.2",
        "TRAINJOBS_WEBHOOK_BACKOFF_SECONDS": "0.5",
    })  # fmt: skip
    live.start()
    try:
        yield live
    finally:
        live.stop()


def wait_until_delivered(client: Client, webhook_id: str, timeout: float = 60.0) -> list[dict[str, object]]:
    deadline = time.monotonic() + timeout
    while True:
        items = client.webhook_deliveries(webhook_id)
        if items and all(item["state"] == "delivered" for item in items):
            return items
        assert time.monotonic() < deadline, [(i["event_type"], i["state"], i["attempt_log"]) for i in items]
        time.sleep(0.3)


def test_webhooks_commands(hooked_service: LiveService) -> None:
    created = hooked_service.cli("webhooks", "create", "http://127.0.0.1:9/hooks", "--event", "job.succeeded",
                                 "--event", "job.failed", "--description", "ci")  # fmt: skip
    assert created.returncode == 0, created.stderr
    webhook_id = created.stdout.strip()
    assert "secret: whsec_" in created.stderr
    listed = hooked_service.cli("webhooks", "list")
    assert webhook_id in listed.stdout and "job.succeeded,job.failed" in listed.stdout and "ci" in listed.stdout
    deliveries = hooked_service.cli("webhooks", "deliveries", webhook_id)
    assert deliveries.returncode == 0 and deliveries.stdout.splitlines()[0].startswith("DELIVERY")
    bad = hooked_service.cli("webhooks", "create", "http://127.0.0.1:9/", "--event", "job.exploded")
    assert bad.returncode == 2 and "events.0:" in bad.stderr
    assert hooked_service.cli("webhooks", "delete", webhook_id).returncode == 0
    assert webhook_id not in hooked_service.cli("webhooks", "list").stdout
    gone = hooked_service.cli("webhooks", "deliveries", webhook_id)
    assert gone.returncode != 0 and "no webhook" in gone.stderr


def test_a_real_job_reaches_a_receiver_that_was_down_across_an_api_restart(
    hooked_service: LiveService, tmp_path: Path
) -> None:
    files = write_sentiment_csv(hooked_service.data_root / "hooks", n_train=96, n_val=32)
    receiver = Receiver()  # its port is chosen, nothing listens yet: every attempt is refused
    client = hooked_service.client()
    hook = client.create_webhook(receiver.url, ["job.queued", "job.running", "job.succeeded", "checkpoint.created"])
    receiver.secret = str(hook["secret"])
    spec = job_spec(files, "hooked", training={"num_train_epochs": 1, "per_device_train_batch_size": 16,
                                               "save_steps": 3})  # fmt: skip
    job = client.submit(spec)
    deadline = time.monotonic() + 240
    # One read a poll: reading it again for the check raced the job's end (running, then succeeded).
    while (current := client.get(job["id"]))["status"] != "succeeded":
        assert current["status"] in ("queued", "running"), current
        assert time.monotonic() < deadline
        time.sleep(0.5)
    hooked_service.kill_api()  # mid-retry: the deliveries wait in the database, not in the API
    hooked_service.start_api()
    client = hooked_service.client()
    waiting = client.webhook_deliveries(str(hook["id"]))
    assert {item["state"] for item in waiting} == {"pending"}
    assert any(item["attempts"] >= 2 for item in waiting)  # retried while the receiver was down
    receiver.start()
    try:
        delivered = wait_until_delivered(client, str(hook["id"]))
    finally:
        receiver.stop()
    assert all(item["verified"] for item in receiver.seen)
    types = [item["body"]["type"] for item in receiver.seen]
    assert types[:2] == ["job.queued", "job.running"] and types[-1] == "job.succeeded", types
    assert set(types[2:-1]) == {"checkpoint.created"}, types
    steps = [item["body"]["data"]["checkpoint"]["step"] for item in receiver.seen[2:-1]]
    assert steps == sorted(steps)
    assert len(receiver.seen) == len(delivered)  # each delivery once, none lost
    done = receiver.seen[-1]["body"]["data"]
    assert done["job_id"] == job["id"] and done["final_metrics"] and done["dashboard_url"].endswith(job["id"])
