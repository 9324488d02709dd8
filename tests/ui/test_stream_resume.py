"""The dashboard's event-stream reader (api/static/js/sse.js) in Chromium: its parsing rules, and a
job page whose connections are all cut mid-job by a TCP proxy between the browser and the service."""

from __future__ import annotations

import dataclasses
import time

import httpx
import pytest
from playwright.sync_api import Page, Request, expect

from bench.chaos_proxy import TcpProxy
from tests.trainer_core.datagen import tiny_text_spec, write_sentiment_csv
from tests.ui.conftest import DevService, Watch, log_in, wait_for_job
from trainjobs.client import Client
from trainjobs.sse import SseEvent, iter_events

pytestmark = pytest.mark.slow

PARSE = """async (chunks) => {
  const { eventParser } = await import("/static/js/sse.js");
  const seen = [];
  const feed = eventParser((event) => seen.push(event));
  chunks.forEach(feed);
  return seen;
}"""


def test_the_reader_parses_ids_kinds_multiline_data_and_drops_a_cut_frame(page: Page, dev: DevService) -> None:
    page.goto(f"{dev.url}/dashboard")
    wire = (
        ': ping\n\nid: 7\nevent: status\ndata: {"status":\n'
        'data: "running"}\n\nid: 8\r\nevent: metric\r\ndata: one\r\ndata: two\r\n\r\n: ping\n\n'
        "data: no id of its own\n\nid: 9\nevent: metric\ndata: cut off"
    )
    expected = [
        {"id": "7", "event": "status", "data": '{"status":\n"running"}'},
        {"id": "8", "event": "metric", "data": "one\ntwo"},
        {"id": "8", "event": "message", "data": "no id of its own"},  # the last id stays, as in EventSource
    ]
    for size in (1, 3, len(wire)):  # split anywhere, CRLF between its CR and LF included
        chunks = [wire[i : i + size] for i in range(0, len(wire), size)]
        assert page.evaluate(PARSE, chunks) == expected, size


def test_a_cut_mid_job_resumes_the_stream_with_last_event_id_and_nothing_twice(
    page: Page, dev: DevService, watch: Watch
) -> None:
    files = write_sentiment_csv(dev.data_root / "sentiment-stream", n_train=96, n_val=32)
    training = {"num_train_epochs": 300, "logging_steps": 1, "eval_strategy": "no"}  # cancelled below
    spec = tiny_text_spec(files, name="cut-streams", training=training, preprocessing={"max_length": 32})
    # A roomy timeout: a fresh service's first submit loads the preflight's libraries, slow on a busy machine.
    client = Client(dev.url, dev.key, timeout=120)
    job_id = client.submit(spec)["id"]
    streams: list[Request] = []
    page.on("request", lambda r: streams.append(r) if f"/v1/jobs/{job_id}/events" in r.url else None)
    with TcpProxy(("127.0.0.1", int(dev.url.rsplit(":", 1)[1]))) as proxy:
        proxied = dataclasses.replace(dev, url=f"http://127.0.0.1:{proxy.port}")
        log_in(page, proxied, f"#/jobs/{job_id}")
        expect(page.locator("tr[data-attempt='1']")).to_have_attribute("data-outcome", "running", timeout=120_000)
        page.wait_for_function("() => +document.querySelector('[data-chart=loss]')?.dataset.points > 0",
                               timeout=120_000)  # fmt: skip
        page.wait_for_selector("[data-charts-ready]")
        loaded = chart_points(page)  # then a point over the metric stream, so it has an id to resume from
        page.wait_for_function(f"() => +document.querySelector('[data-chart=loss]').dataset.points > {loaded}")
        at_cut = chart_points(page)
        running = first_status(dev, job_id, "running")
        # Two streams: the attempts' status events, and the charts' metric and eval events (with the
        # checkpoint events the checkpoints tab and the chart markers follow).
        kinds = [r.url.split("?")[1].split("&after=")[0] for r in streams]
        assert kinds == ["kind=status", "kind=metric&kind=eval&kind=checkpoint"]
        # Chromium logs each request the cut fails; those are the point of this test, not faults.
        watch.expect_network_errors(proxied.url)
        status_stream = f"/v1/jobs/{job_id}/events?kind=status"
        with page.expect_request(lambda r: status_stream in r.url, timeout=30_000) as resumed:
            proxy.cut()  # every open connection reset: the event streams, the polls
            proxy.restore()  # listening again on the same port
        # The streams came back by themselves, asking for what follows the last event each had...
        assert resumed.value.headers.get("last-event-id") == running.id
        deadline = time.monotonic() + 30
        while len(streams) < 4 and time.monotonic() < deadline:
            page.wait_for_timeout(100)
        metric_resumed = [r for r in streams[2:] if "kind=metric" in r.url]
        assert metric_resumed and int(metric_resumed[0].headers["last-event-id"]) > int(running.id)
        # ...and the charts go on growing.
        page.wait_for_function(f"() => +document.querySelector('[data-chart=loss]').dataset.points > {at_cut}")
        client.cancel(job_id)  # the final status must arrive over the resumed stream
        expect(page.locator(".job-header .badge")).to_have_text("cancelled", timeout=60_000)
        expect(page.locator("tr[data-attempt='1']")).to_have_attribute("data-outcome", "cancelled")
        # One attempt: a replay from the start would have added a second (queued, running again).
        expect(page.locator("[data-attempts]")).to_have_attribute("data-attempts", "1")
        ended = wait_for_job(client, job_id, lambda j: j["finished_at"] is not None, timeout=60)
        assert ended["status"] == "cancelled"
        points = [p for p in client.metrics(job_id, name="loss") if p["value"] is not None]
        expect(page.locator("[data-chart=loss]")).to_have_attribute("data-points", str(len(points)))


def chart_points(page: Page) -> int:
    return int(page.get_attribute("[data-chart=loss]", "data-points") or 0)


def first_status(dev: DevService, job_id: str, status: str) -> SseEvent:
    """The job's first status event with ``status``, read from the service directly (not proxied)."""
    url = f"{dev.url}/v1/jobs/{job_id}/events?kind=status"
    with httpx.stream("GET", url, headers={"Authorization": f"Bearer {dev.key}"}, timeout=30) as response:
        return next(e for e in iter_events(response) if e.data["status"] == status)
