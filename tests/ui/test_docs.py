"""``/docs`` and ``/redoc`` in headless Chromium with every request off 127.0.0.1 refused: they load
from package files, Authorize takes the Bearer key, and the submit example as it stands ("Try it
out", Execute) gives a job that succeeds on what ``trainjobs dev --example`` placed in the data root."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from tests.ui.conftest import DevService, wait_for_job

pytestmark = pytest.mark.slow
Shot = Callable[..., Path]


def test_swagger_ui_offline_authorize_and_the_submit_example_succeeds(page: Page, dev: DevService, shot: Shot) -> None:
    page.goto(f"{dev.url}/docs")
    expect(page.locator(".swagger-ui .info .title")).to_contain_text("trainjobs")
    page.click("button.authorize")
    page.fill(".auth-container input", dev.key)
    page.click(".auth-btn-wrapper button.authorize")
    page.click(".auth-btn-wrapper button.btn-done")
    submit = page.locator("#operations-jobs-submit_job_v1_jobs_post")
    submit.locator(".opblock-summary").click()
    body = json.loads(submit.locator("textarea.body-param__text").input_value())
    assert body["model"]["name_or_path"] == "models/all-MiniLM-L6-v2"  # the example, unedited
    submit.locator("button.execute").click()
    status = submit.locator(".live-responses-table tbody .response-col_status").first
    expect(status).to_contain_text("201", timeout=60_000)
    status.scroll_into_view_if_needed()
    shot(page, "09-docs-try-it-out", full_page=False)
    created = json.loads(submit.locator(".live-responses-table .microlight").first.inner_text())
    job = wait_for_job(dev.client(), created["id"], lambda j: j["finished_at"] is not None, timeout=300)
    assert job["status"] == "succeeded", job["error"]
    assert job["final_metrics"]["eval_accuracy"] is not None


def test_redoc_renders_offline(page: Page, dev: DevService, shot: Shot) -> None:
    page.goto(f"{dev.url}/redoc")
    expect(page.locator("h1").first).to_contain_text("trainjobs", timeout=30_000)
    expect(page.locator("h2", has_text="Submit Job")).to_be_visible()
    shot(page, "10-redoc", full_page=False)
