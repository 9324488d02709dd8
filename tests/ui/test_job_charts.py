"""The job page's charts in Chromium against a live ``trainjobs dev`` (issue 26): tick labels for small
values (a learning rate of 5e-5), fraction metrics' axes within [0, 1], legends with no empty rows,
and new points that arrive over the job's event stream with no metrics polling."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator

import pytest
from playwright.sync_api import Page, Request, Route, expect

from tests.trainer_core.datagen import tiny_text_spec, write_sentiment_csv
from tests.ui.conftest import DevService, Watch, log_in, wait_for_job
from trainjobs.client import Client

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def running(dev: DevService) -> Iterator[str]:
    """A long job at learning rate 5e-5 with accuracy and f1 evaluated each epoch; cancelled at the end."""
    files = write_sentiment_csv(dev.data_root / "sentiment-charts", n_train=96, n_val=32)
    training = {"num_train_epochs": 300, "logging_steps": 1, "eval_strategy": "epoch", "learning_rate": 5e-5}
    spec = tiny_text_spec(files, name="charts-live", training=training, preprocessing={"max_length": 32})
    client = Client(dev.url, dev.key, timeout=120)
    job_id = client.submit(spec)["id"]
    yield job_id
    client.cancel(job_id)  # the worker slot is free for the tests after these
    wait_for_job(client, job_id, lambda j: j["finished_at"] is not None, timeout=90)


def points(page: Page, name: str) -> int:
    return int(page.get_attribute(f"[data-chart={name}]", "data-points") or 0)


def open_with_points(page: Page, dev: DevService, job_id: str, name: str, at_least: int = 1) -> None:
    log_in(page, dev, f"#/jobs/{job_id}")
    page.wait_for_function(f"() => +document.querySelector('[data-chart={name}]')?.dataset.points >= {at_least}",
                           timeout=180_000)  # fmt: skip


def test_new_points_arrive_over_the_event_stream_with_no_metrics_polling(
    page: Page, dev: DevService, running: str
) -> None:
    requests: list[Request] = []
    page.on("request", lambda r: requests.append(r) if f"/v1/jobs/{running}" in r.url else None)
    open_with_points(page, dev, running, "loss")
    page.wait_for_selector("[data-charts-ready]")
    loaded = points(page, "loss")
    page.wait_for_function(f"() => +document.querySelector('[data-chart=loss]').dataset.points > {loaded}")

    # Two of the page's polls of the job go by (the page used to fetch new points with each one).
    def polls() -> list[Request]:
        return [r for r in requests if r.url.endswith(f"/v1/jobs/{running}")]

    deadline = time.monotonic() + 30
    while len(polls()) < 3 and time.monotonic() < deadline:
        page.wait_for_timeout(200)  # (Playwright delivers request events while it waits)
    assert len(polls()) >= 3
    # The chart grew, and the one metrics fetch is the load's: the new points came over the stream.
    metric_fetches = [r.url for r in requests if "/metrics" in r.url]
    assert len(metric_fetches) == 1 and "max_points=" in metric_fetches[0], metric_fetches
    streams = [r.url for r in requests if "/events?kind=metric&kind=eval" in r.url]
    assert len(streams) == 1, streams  # one stream, still open: nothing reconnected or fell back
    assert points(page, "loss") > loaded


def test_a_refused_stream_falls_back_to_fetching_new_points(
    page: Page, dev: DevService, running: str, watch: Watch
) -> None:
    # Over the owner's stream limit (TRAINJOBS_MAX_STREAMS_PER_OWNER): the server answers 429.
    watch.expect_status(f"/v1/jobs/{running}/events", 429)
    problem = {"title": "Too Many Requests", "status": 429, "detail": "at most 16 open event streams per owner"}

    def refuse(route: Route) -> None:
        route.fulfill(status=429, content_type="application/problem+json", body=json.dumps(problem))

    page.route(re.compile(rf"/v1/jobs/{running}/events\?kind=metric"), refuse)
    open_with_points(page, dev, running, "loss")
    page.wait_for_selector("[data-charts-ready]")
    loaded = points(page, "loss")
    with page.expect_response(lambda r: f"/v1/jobs/{running}/metrics?after=" in r.url and r.ok):
        pass
    page.wait_for_function(f"() => +document.querySelector('[data-chart=loss]').dataset.points > {loaded}")


def test_learning_rate_ticks_read_as_small_values(page: Page, dev: DevService, running: str) -> None:
    open_with_points(page, dev, running, "learning_rate", at_least=2)
    ticks = json.loads(page.get_attribute("[data-chart=learning_rate]", "data-y-ticks") or "[]")
    # The default format's three decimals printed every tick of a 5e-5 learning rate as "0".
    assert len(ticks) >= 2 and len(set(ticks)) == len(ticks), ticks
    values = [float(t) for t in ticks]
    assert any(values) and all(abs(v) <= 1e-4 for v in values), ticks
    assert all(re.fullmatch(r"0|-?\d(\.\d+)?e-\d+", t) for t in ticks), ticks  # 5e-5, 2.5e-5


def test_legends_show_values_only_where_there_are_some(page: Page, dev: DevService, running: str) -> None:
    open_with_points(page, dev, running, "loss", at_least=3)
    texts = page.locator("[data-chart] [data-legend]").all_inner_texts()
    assert texts and not [t for t in texts if "--" in t or "(raw)" in t], texts
    loss = page.locator("[data-chart=loss]")
    expect(loss.locator(".series")).to_have_count(1)  # the raw series has no row of its own
    # Away from the plot: the latest point's step and value, smoothed and raw.
    value = re.compile(r"^\s*-?\d\S*( \(raw -?\d\S*\))?$")
    expect(loss.locator("[data-step]")).to_have_text(re.compile(r"^latest: step \d+$"))
    expect(loss.locator(".series .value")).to_have_text(value)
    # Over it: the hovered step's (the chart scrolled into view first: the pointer only hovers what is seen).
    loss.scroll_into_view_if_needed()
    box = loss.locator(".u-over").bounding_box()
    assert box is not None
    page.mouse.move(box["x"] + box["width"] * 0.4, box["y"] + box["height"] / 2)
    expect(loss.locator("[data-step]")).to_have_text(re.compile(r"^step \d+$"))
    expect(loss.locator(".series .value")).to_have_text(value)
    page.mouse.move(1, 1)
    expect(loss.locator("[data-step]")).to_have_text(re.compile(r"^latest: step \d+$"))


def test_fraction_metrics_keep_their_axis_within_0_and_1(page: Page, dev: DevService, running: str) -> None:
    # One eval at a perfect 1.0 (a tiny set): uPlot's own range for it runs from 0 to 2.
    # A preference job's share of pairs ranked right is a fraction too; its margin is not.
    names = ("eval_accuracy", "eval_f1", "eval_loss", "rewards/accuracies", "eval_rewards/accuracies",
             "rewards/margins")  # fmt: skip
    items = [{"seq": 7, "step": 6, "epoch": 1.0, "name": name, "value": 1.0, "time": "2026-01-01T00:00:00Z"}
             for name in names]  # fmt: skip
    page_body = json.dumps({"items": items, "next_after": 10**15, "has_more": False})  # the stream adds nothing

    def thinned(route: Route) -> None:
        route.fulfill(status=200, content_type="application/json", body=page_body)

    page.route(re.compile(rf"/v1/jobs/{running}/metrics\?max_points="), thinned)
    open_with_points(page, dev, running, "eval_loss")
    for name in ("eval_accuracy", "eval_f1", "rewards/accuracies", "eval_rewards/accuracies"):  # fractions
        low, high = json.loads(page.get_attribute(f'[data-chart="{name}"]', "data-y-range") or "[]")
        assert 0 <= low < high == 1, (name, low, high)
        ticks = json.loads(page.get_attribute(f'[data-chart="{name}"]', "data-y-ticks") or "[]")
        assert ticks and all(0 <= float(t) <= 1 for t in ticks), ticks
    for name in ("eval_loss", "rewards/margins"):  # no fractions: their axes are uPlot's own
        low, high = json.loads(page.get_attribute(f'[data-chart="{name}"]', "data-y-range") or "[]")
        assert high > 1, (name, low, high)
