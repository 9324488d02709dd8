"""Cost and usage in Chromium against a live ``trainjobs dev`` (issue 29): the job page's time-and-cost card
shows what the API charged at the queue's price, and the usage page's totals, table and daily chart are
the API's ``GET /v1/usage``."""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page, expect

from tests.trainer_core.datagen import tiny_text_spec, write_sentiment_csv
from tests.ui.conftest import PRICE, DevService, log_in, wait_for_job
from trainjobs.client import Client

pytestmark = pytest.mark.slow
Shot = Callable[..., Path]


def js_num(value: float, digits: int) -> str:
    """What the dashboard's ``num(value, digits)`` (api/static/js/util.js) prints."""
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
        mantissa, exponent = f"{value:.2e}".split("e")
        return f"{mantissa}e{int(exponent)}"
    rounded = float(f"{value:.{digits}g}")
    return str(int(rounded)) if rounded.is_integer() else repr(rounded)


def js_money(value: float) -> str:
    """What the dashboard's ``money(value)`` (api/static/js/panels.js) prints: whole units from 100,
    cents from a cent, significant digits below."""
    if value >= 100:
        return f"{value:.0f}"
    if value >= 0.01 or value == 0:
        return f"{value:.2f}"
    return js_num(value, 2)


@pytest.fixture(scope="module")
def finished(dev: DevService) -> dict[str, Any]:
    files = write_sentiment_csv(dev.data_root / "sentiment-usage", n_train=48, n_val=16)
    client = Client(dev.url, dev.key, timeout=120)
    job_id = client.submit(tiny_text_spec(files, name="usage-priced", training={"max_steps": 4}))["id"]
    job = wait_for_job(client, job_id, lambda j: j["finished_at"] is not None, timeout=300)
    assert job["status"] == "succeeded", job["error"]
    return job


def test_the_job_page_shows_the_charge_at_the_queues_price(
    page: Page, dev: DevService, finished: dict[str, Any], shot: Shot
) -> None:
    usage = finished["usage"]
    assert usage["price_per_device_hour"] == PRICE and usage["device_hours"] > 0
    log_in(page, dev, f"#/jobs/{finished['id']}")
    card = page.locator("[data-time-cost]")
    expect(card).to_be_visible()
    hours = card.locator("[data-row=device-hours] td").nth(2)
    expect(hours).to_have_text(js_num(usage["device_hours"], 3))
    # (below a cent, in significant digits: "0.00" would say the run was free)
    expect(card.locator("[data-row=cost] td").nth(2)).to_have_text(js_money(usage["cost"]))
    expect(card).to_contain_text(f"{PRICE} per device-hour")
    shot(page, "job-time-cost", full_page=False)


def test_the_usage_page_is_the_apis_answer(page: Page, dev: DevService, finished: dict[str, Any], shot: Shot) -> None:
    log_in(page, dev, "#/usage")
    page.wait_for_selector("[data-total-hours]")
    page.select_option("select[name=group_by]", "queue")
    # The page's period: this UTC month up to the start of tomorrow (UTC), as its date fields say.
    now = datetime.now(UTC)
    start = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
    end = (now + timedelta(days=1)).replace(hour=0, minute=0, second=0, microsecond=0)
    expect(page.locator("input[name=from]")).to_have_value(start.date().isoformat())
    expect(page.locator("input[name=to]")).to_have_value(end.date().isoformat())
    report = Client(dev.url, dev.key).usage(start=start.isoformat(), end=end.isoformat(), group_by="queue")
    assert report["total"]["jobs"].get("succeeded", 0) >= 1
    default = next(g for g in report["groups"] if g["key"] == "default")
    row = page.locator("table.usage tr[data-group=default] td")
    expect(row.nth(0)).to_have_text("default")
    expect(row.nth(2)).to_have_text(js_money(default["cost"]))
    total = page.locator("[data-total-hours]")
    expect(total).to_have_text(js_num(report["total"]["device_hours"], 4))
    # The chart: one bar per day of the period, today's the day's device-hours.
    assert page.locator(".usage-chart canvas").count() == 1
    assert page.evaluate("document.querySelector('.usage-chart .u-title').textContent") == "device-hours per day (UTC)"
    shot(page, "usage", full_page=False)
