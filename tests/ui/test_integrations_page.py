"""Integrations in Chromium against a live ``trainjobs dev`` (issue 30): the webhooks page adds a webhook
whose secret a real receiver then verifies deliveries with, lists the deliveries of a real job, sends
one again, rotates the secret and deletes the webhook, and says so when a button's request fails; the
job page links the job's MLflow run on a real ``mlflow server``."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from tests.mlflow_server import MlflowServer
from tests.trainer_core.datagen import tiny_text_spec, write_sentiment_csv
from tests.ui.conftest import DevService, Watch, log_in, wait_for_job
from tests.worker.test_webhooks import Receiver
from trainjobs.client import Client

pytestmark = pytest.mark.slow
Shot = Callable[..., Path]


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    live = Receiver().start()
    yield live
    live.stop()


def wait_seen(receiver: Receiver, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while len(receiver.seen) < count and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(receiver.seen) >= count, receiver.types()


def test_the_webhooks_page_and_the_job_pages_tracker_link(
    page: Page, dev: DevService, receiver: Receiver, mlflow_tracking: MlflowServer, shot: Shot, watch: Watch
) -> None:
    log_in(page, dev, "#/webhooks")
    form = page.locator("form.webhook-create")
    form.locator("input[name=url]").fill(receiver.url)
    form.locator("input[name=description]").fill("ui receiver")
    for box in form.locator("input[name=event]").all():  # only the end of the job: one delivery a job
        box.set_checked(box.get_attribute("value") == "job.succeeded")
    form.locator("button[type=submit]").click()
    card = page.locator("section.webhook", has_text=receiver.url)
    expect(card).to_be_visible()
    hook_id = card.get_attribute("data-webhook")
    secret = page.locator(f"[data-secret-for='{hook_id}'] pre")
    receiver.secret = secret.inner_text()
    assert receiver.secret.startswith("whsec_")

    # A real job, reporting to the real MLflow server (allowed on 127.0.0.1 by the dev service's
    # TRAINJOBS_ALLOW_PRIVATE_TARGETS, a testing aid).
    files = write_sentiment_csv(dev.data_root / "sentiment-hooks", n_train=32, n_val=8)
    spec = tiny_text_spec(files, name="hooked", training={"max_steps": 2, "report_to": ["mlflow"]})
    spec["integrations"] = {"mlflow": {"tracking_uri": mlflow_tracking.url, "experiment": f"ui-{uuid.uuid4().hex}"}}
    client = Client(dev.url, dev.key, timeout=120)
    job = client.submit(spec)
    job = wait_for_job(client, job["id"], lambda j: j["finished_at"] is not None, timeout=300)
    assert job["status"] == "succeeded", job["error"]
    wait_seen(receiver, 1)
    (first,) = receiver.seen
    assert first["verified"] and first["body"]["type"] == "job.succeeded"
    assert first["body"]["data"]["job_id"] == job["id"]

    # The page refreshes on its own: the delivery appears, delivered, with its job.
    row = card.locator("tr[data-state=delivered]")
    expect(row).to_have_count(1, timeout=20_000)
    expect(row.locator("a")).to_have_attribute("href", f"#/jobs/{job['id']}")
    expect(row).to_contain_text("HTTP 200")
    # The page polls, and a poll that changed nothing keeps the elements shown: a button drawn again
    # between a press and its release would swallow the click (the page draws before it asks for the
    # deliveries, so their answer comes after a drawing; a relative time that turned meanwhile, say
    # "1 min ago", is a change).
    row.evaluate("(node) => { window.kept = [node, node.closest('div.webhooks').innerHTML]; }")
    with page.expect_response(lambda response: "/deliveries?" in response.url, timeout=15_000):
        pass
    redrawn_unchanged = ("() => !window.kept[0].isConnected"
                         " && document.querySelector('div.webhooks').innerHTML === window.kept[1]")
    assert not page.evaluate(redrawn_unchanged), "a poll drew the unchanged deliveries again"
    shot(page, "webhooks", full_page=False)
    row.locator("button", has_text="Redeliver").click()
    wait_seen(receiver, 2)
    assert receiver.seen[1]["verified"] and receiver.seen[1]["body"] == first["body"]
    expect(card.locator("tr[data-state=delivered]")).to_have_count(2, timeout=20_000)

    card.locator("button", has_text="Rotate secret").click()
    expect(secret).not_to_have_text(receiver.secret)
    assert secret.inner_text().startswith("whsec_")
    page.once("dialog", lambda dialog: dialog.accept())
    card.locator("button", has_text="Delete").click()
    expect(card).to_have_count(0)
    assert all(hook["id"] != hook_id for hook in client.webhooks())

    # A button whose request fails says so on the page: a webhook deleted elsewhere meanwhile. Right
    # after a poll's answer, so that the next poll (5 s later) has not dropped its card yet.
    other = client.create_webhook(receiver.url, ["job.succeeded"], description="deleted elsewhere")
    stale = page.locator(f"section.webhook[data-webhook='{other['id']}']")
    expect(stale).to_be_visible(timeout=15_000)
    with page.expect_response(lambda response: f"/{other['id']}/deliveries?" in response.url, timeout=15_000):
        pass
    client.delete_webhook(other["id"])
    watch.expect_status(f"/v1/webhooks/{other['id']}/rotate-secret", 404)
    stale.locator("button", has_text="Rotate secret").click()
    expect(page.locator("p.error", has_text=f"no webhook {other['id']!r}")).to_be_visible()
    expect(stale).to_have_count(0, timeout=15_000)  # and the next poll drops the card

    links = job["tracker_links"]
    page.goto(f"{dev.url}/dashboard#/jobs/{job['id']}")  # signed in already (the key is in the session)
    link = page.locator("[data-tracker=mlflow] a")
    expect(link).to_have_attribute("href", links["mlflow"]["url"])
    assert links["mlflow"]["url"].startswith(f"{mlflow_tracking.url}/#/experiments/")
    expect(link).to_have_text(links["mlflow"]["run_id"])
