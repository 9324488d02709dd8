"""The job page's Pause and Resume buttons in Chromium, on a real run of a live ``trainjobs dev``: Pause
turns the running job ``paused`` (its run checkpointed), Resume puts it back to continue from there. The
page also shows the learning rate the spec left to ``auto``."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from tests.trainer_core.datagen import tiny_text_spec, write_sentiment_csv
from tests.ui.conftest import DevService, log_in, wait_for_job
from trainjobs.client import Client

pytestmark = pytest.mark.slow
Shot = Callable[..., Path]


def test_pause_then_resume_from_the_job_page(page: Page, dev: DevService, shot: Shot) -> None:
    files = write_sentiment_csv(dev.data_root / "sentiment-pause", n_train=96, n_val=16)
    client = Client(dev.url, dev.key, timeout=60)
    # Thousands of ~20 ms steps: it is still running when the button is pressed (and is cancelled below).
    training = {"num_train_epochs": 500, "eval_strategy": "no", "learning_rate": "auto"}
    job_id = client.submit(tiny_text_spec(files, name="pausable", training=training))["id"]
    wait_for_job(client, job_id, lambda j: j["status"] == "running" and j["progress"]["step"] >= 2, timeout=120)

    log_in(page, dev, f"#/jobs/{job_id}")
    (chosen,) = client.get(job_id)["auto"]  # the rate `auto` chose at submit, shown with its reason
    rate = page.locator("[data-auto] [data-field='training.learning_rate']")
    expect(rate).to_contain_text(str(chosen["value"]))
    expect(rate).to_contain_text(chosen["why"])
    page.click("button[data-action=pause]")
    badge = page.locator(".job-header .badge")
    expect(badge).to_have_text("paused", timeout=60_000)
    paused = client.get(job_id)
    assert paused["status"] == "paused" and 2 <= paused["progress"]["step"] < paused["progress"]["total"]
    shot(page, "job-paused", full_page=False)

    page.click("button[data-action=resume]")
    expect(badge).not_to_have_text("paused", timeout=20_000)
    resumed = wait_for_job(client, job_id, lambda j: j["attempts"] == 2 and j["status"] == "running", timeout=120)
    assert resumed["status"] == "running"
    expect(page.locator("button[data-action=pause]")).to_be_visible()
    client.cancel(job_id)
    done = wait_for_job(client, job_id, lambda j: j["finished_at"] is not None, timeout=120)
    assert done["status"] == "cancelled"
