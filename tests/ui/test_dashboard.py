"""The dashboard in headless Chromium against a live ``trainjobs dev``: log in, the list, a running
job's live charts, memory bar and logs, cancel, a failed job's reason and attempts, the submit page's estimate
and suggestions, compare, a multi-node job's gang. The tests run in file order and share one service (one
worker slot runs the jobs one after another); every page also fails on console errors and requests off
127.0.0.1. The job page and the list poll, and a poll draws again only what changed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml
from playwright.sync_api import Page, expect

from tests.trainer_core.datagen import tiny_text_spec, write_sentiment_csv
from tests.ui.conftest import OOM_ABOVE, DevService, Watch, log_in, wait_for_job

pytestmark = pytest.mark.slow
Shot = Callable[..., Path]


@pytest.fixture(scope="module")
def files(dev: DevService) -> dict[str, str]:
    return write_sentiment_csv(dev.data_root / "sentiment", n_train=96, n_val=32)


def tiny(files: dict[str, str], name: str, epochs: int) -> dict[str, Any]:
    training = {"num_train_epochs": epochs, "logging_steps": 1, "eval_strategy": "epoch"}
    return tiny_text_spec(files, name=name, training=training, preprocessing={"max_length": 32})


@pytest.fixture(scope="module")
def jobs(dev: DevService, files: dict[str, str]) -> dict[str, str]:
    """A long job (cancelled by a test below); later tests add theirs."""
    return {"long": dev.client().submit(tiny(files, "long-run", epochs=300))["id"]}


def assert_a_poll_keeps(page: Page, selector: str, polled: str) -> None:
    """The element at ``selector`` is still the same element after the page's next poll (a request whose
    path is ``polled``), unless what it shows changed (a relative time such as "1 min ago" may turn)."""
    page.eval_on_selector(selector, "(node) => { window.kept = [node, node.outerHTML]; }")
    with page.expect_response(lambda response: urlparse(response.url).path == polled, timeout=15_000):
        pass
    page.wait_for_timeout(200)  # the answer drawn
    redrawn_unchanged = "() => !window.kept[0].isConnected && document.querySelector(%s)?.outerHTML === window.kept[1]"
    assert not page.evaluate(redrawn_unchanged % json.dumps(selector)), f"a poll drew {selector} again unchanged"


def chart_points(page: Page, name: str) -> int:
    return int(page.get_attribute(f"[data-chart={name}]", "data-points") or 0)


def test_log_in_and_the_list_shows_the_job(page: Page, dev: DevService, jobs: dict[str, str], shot: Shot) -> None:
    log_in(page, dev)
    row = page.locator(f"tr[data-job-id='{jobs['long']}']")
    expect(row).to_contain_text("long-run")
    expect(row.locator(".badge")).to_have_text(re.compile("queued|running"))
    shot(page, "01-job-list")
    # Kept for this tab only ("remember" was not ticked); logging out forgets it and asks again.
    assert page.evaluate("sessionStorage.getItem('trainjobs.key')") == dev.key
    assert page.evaluate("localStorage.getItem('trainjobs.key')") is None
    page.click("#logout")
    expect(page.locator("form.login")).to_be_visible()
    assert page.evaluate("sessionStorage.getItem('trainjobs.key')") is None


def test_job_page_charts_grow_live_with_the_memory_bar(
    page: Page, dev: DevService, jobs: dict[str, str], shot: Shot
) -> None:
    log_in(page, dev, f"#/jobs/{jobs['long']}")
    page.wait_for_function("() => +document.querySelector('[data-chart=loss]')?.dataset.points > 0", timeout=90_000)
    first = chart_points(page, "loss")
    # New points arrive while the job runs: the same chart, more points, no reload.
    page.wait_for_function(f"() => +document.querySelector('[data-chart=loss]').dataset.points > {first}")
    assert page.locator("[data-chart=loss] canvas").count() == 1
    assert page.locator("[data-chart=learning_rate]").count() == 1
    job = dev.client().get(jobs["long"])
    total = job["estimate"]["total_bytes"]
    assert page.get_attribute(".stack", "data-total") == str(total)
    parts = [p["name"] for p in job["estimate"]["parts"] if p["bytes"] > 0]
    assert page.eval_on_selector_all(".stack .part", "els => els.map(e => e.dataset.part)") == parts
    shot(page, "02-job-running")
    # A poll draws again only what changed: the progress moves while the spec stays the same element,
    # so a selection in it is not lost every two seconds.
    page.click("nav.tabs a[data-tab=spec]")
    assert_a_poll_keeps(page, "pre.spec", f"/v1/jobs/{jobs['long']}")


def test_cancel_with_confirm_stops_the_running_job_and_logs_show_its_output(
    page: Page, dev: DevService, jobs: dict[str, str], shot: Shot
) -> None:
    running = wait_for_job(dev.client(), jobs["long"], lambda j: j["progress"]["step"] > 0, timeout=120)
    assert running["status"] == "running"  # (a queued job is cancelled at once, with no run to stop)
    log_in(page, dev, f"#/jobs/{jobs['long']}")
    page.click("button:has-text('Cancel')")
    expect(page.locator(".cancel")).to_contain_text("Cancel this job?")
    # The page polls the job; the question stays open across a poll.
    with page.expect_response(lambda r: r.url.endswith(f"/v1/jobs/{jobs['long']}")):
        pass
    expect(page.locator(".cancel")).to_contain_text("Cancel this job?")
    assert dev.client().get(jobs["long"])["cancel_requested"] is False  # nothing happens before "Yes"
    page.click("button:has-text('Yes, cancel')")
    expect(page.locator(".job-header .badge")).to_have_text("cancelled", timeout=60_000)
    assert dev.client().get(jobs["long"])["status"] == "cancelled"
    shot(page, "03-job-cancelled")
    # The logs tab shows the run's output (this tiny run writes its stop notice and the final save).
    page.click("nav.tabs a[data-tab=logs]")
    logs = dev.client()._json("GET", f"/v1/jobs/{jobs['long']}/logs")["text"]
    assert "SIGTERM" in logs
    expect(page.locator("[data-logs]")).to_contain_text(logs.splitlines()[0])
    shot(page, "04-job-logs")


def test_a_failed_job_shows_its_reason_whole_message_and_attempts(
    page: Page, dev: DevService, files: dict[str, str], jobs: dict[str, str], shot: Shot
) -> None:
    # Two real failures in one short job: its micro-batch is above the service's out-of-memory fault
    # (conftest), so the first attempt is retried with half of it; lr 10 with decoupled weight decay
    # 10 then multiplies every weight by -99 per step, and the run stops with nan_loss.
    training = {"max_steps": 40, "logging_steps": 1, "learning_rate": 10.0, "weight_decay": 10.0,
                "max_grad_norm": 0.0, "per_device_train_batch_size": 2 * OOM_ABOVE, "eval_strategy": "no"}  # fmt: skip
    spec = tiny_text_spec(files, name="diverging", training=training, preprocessing={"max_length": 32})
    jobs["failed"] = dev.client().submit(spec)["id"]
    failed = wait_for_job(dev.client(), jobs["failed"], lambda j: j["finished_at"] is not None, timeout=180)
    assert failed["status"] == "failed" and failed["error"]["reason"] == "nan_loss", failed["error"]
    assert "training.learning_rate" in failed["error"]["message"]
    assert failed["attempts"] == 2 and len(failed["retries"]) == 1
    retry = failed["retries"][0]
    # Switching from a job with charts to this one leaves none of the previous job's charts behind.
    log_in(page, dev, f"#/jobs/{jobs['long']}")
    page.wait_for_selector("[data-chart=loss]")
    page.evaluate(f"location.hash = '#/jobs/{jobs['failed']}'")
    expect(page.locator("[data-failure] code")).to_have_text("nan_loss")
    expect(page.locator("[data-failure] pre.message")).to_have_text(failed["error"]["message"])
    # This job's own loss chart, not the previous job's: its finite points (the last ones were NaN).
    losses = [p["value"] for p in dev.client().metrics(jobs["failed"], name="loss")]
    finite = [v for v in losses if v is not None]
    assert losses[-3:] == [None, None, None] and finite
    expect(page.locator("[data-chart=loss]")).to_have_attribute("data-points", str(len(finite)))
    # The whole message is readable: wrapped inside the panel, not cut off at its edge.
    widths = page.eval_on_selector("[data-failure] pre.message", "e => [e.scrollWidth, e.clientWidth]")
    assert widths[0] <= widths[1]
    assert page.locator(".job-header .badge").inner_text() == "failed"
    # Attempts: the first ended in an out-of-memory retry (its message and the changes applied), the
    # second in the failure.
    expect(page.locator("[data-attempts]")).to_have_attribute("data-attempts", "2")
    first, second = page.locator("tr[data-attempt='1']"), page.locator("tr[data-attempt='2']")
    expect(first).to_have_attribute("data-reason", "out_of_memory")
    expect(first.locator(".badge")).to_have_text("requeued")
    expect(first.locator("pre.message")).to_have_text(retry["message"])
    for field, value in retry["changes"].items():
        expect(first.locator(".changes")).to_contain_text(f"{field} → {value}")
    assert retry["changes"]["training.per_device_train_batch_size"] == OOM_ABOVE
    expect(second).to_have_attribute("data-outcome", "failed")
    expect(second.locator("code")).to_have_text("nan_loss")
    expect(second.locator("pre.message")).to_have_text(failed["error"]["message"])
    shot(page, "05-job-failed")


def test_submit_page_estimates_suggests_and_submits(
    page: Page, dev: DevService, files: dict[str, str], jobs: dict[str, str], shot: Shot, watch: Watch
) -> None:
    log_in(page, dev, f"#/submit/{jobs['long']}")  # clone: the editor starts from that job's spec
    editor = page.locator("textarea[name=spec]")
    cloned = json.loads(editor.input_value())
    assert cloned["name"] == "long-run-clone"
    page.click("button[name=as-yaml]")  # the same spec, shown as YAML
    assert not editor.input_value().lstrip().startswith("{") and yaml.safe_load(editor.input_value()) == cloned
    page.select_option("select[name=gpu]", "4")
    too_big = {
        "name": "bert-large", "task": "text-classification", "model": {"name_or_path": "bert-large-uncased"},
        "dataset": {"path": "csv", "data_files": files}, "preprocessing": {"max_length": 128},
        "training": {"per_device_train_batch_size": 32}, "optimizer": {"name": "adamw"},
    }  # fmt: skip
    editor.fill(json.dumps(too_big, indent=2))
    expect(page.locator("[data-verdict]")).to_contain_text("does not fit", timeout=60_000)
    assert dev.client().estimate(too_big, gpu_memory_gb=4)["estimate"]["fits"] is False
    suggestions = page.locator("[data-suggestions] li")
    expect(suggestions.first).to_contain_text("instead of")
    shot(page, "06-submit-does-not-fit")
    suggestions.first.locator("button").click()  # one click applies the planner's change
    expect(page.locator("[data-verdict]")).to_contain_text("fits:", timeout=60_000)
    assert json.loads(editor.input_value())["training"]["per_device_train_batch_size"] < 32

    # A bad field: the server's 422 names it; the page marks its line beside the text.
    watch.expect_status("/v1/estimates", 422)
    bad = tiny(files, "bad-rate", epochs=1)
    bad["training"]["learning_rate"] = -1
    editor.fill(json.dumps(bad, indent=2))
    expect(page.locator("[data-field-errors]")).to_contain_text("training.learning_rate", timeout=60_000)
    line = json.dumps(bad, indent=2).splitlines().index('    "learning_rate": -1,') + 1
    expect(page.locator("pre.gutter span.bad")).to_have_text(str(line))
    # The same in YAML: its own line is marked (a different one, so the mark is not the JSON's).
    bad_yaml = yaml.safe_dump(bad, sort_keys=False)
    yaml_line = bad_yaml.splitlines().index("  learning_rate: -1") + 1
    assert yaml_line != line
    editor.fill(bad_yaml)
    expect(page.locator("pre.gutter span.bad")).to_have_text(str(yaml_line), timeout=60_000)
    expect(page.locator("[data-field-errors]")).to_contain_text(f"training.learning_rate line {yaml_line}")

    # The fitting spec goes in as YAML.
    fitting = tiny(files, "from-the-dashboard", epochs=2)
    editor.fill(yaml.safe_dump(fitting, sort_keys=False))
    expected = dev.client().estimate(fitting, gpu_memory_gb=4)["estimate"]
    assert expected["fits"] is True
    # The verdict shown is this spec's (not the one before the edit): same total as the API's.
    expect(page.locator(f"[data-verdict][data-total='{expected['total_bytes']}']")).to_have_text(
        re.compile(r"^fits: "), timeout=60_000
    )
    shot(page, "07-submit-fits")
    page.click("button:has-text('Submit job')")
    page.wait_for_url("**/dashboard#/jobs/*")
    job_id = page.url.split("#/jobs/")[1].split("/")[0]
    assert dev.client().get(job_id)["name"] == "from-the-dashboard"
    jobs["submitted"] = job_id


def test_compare_overlays_two_jobs_and_lists_differing_fields(
    page: Page, dev: DevService, jobs: dict[str, str], shot: Shot
) -> None:
    done = wait_for_job(dev.client(), jobs["submitted"], lambda j: j["finished_at"] is not None, timeout=180)
    assert done["status"] == "succeeded", done["error"]
    client = dev.client()
    counts = [len(client.metrics(job_id, name="loss")) for job_id in (jobs["long"], jobs["submitted"])]
    log_in(page, dev, f"#/compare/{jobs['long']},{jobs['submitted']}")
    page.wait_for_selector("[data-chart=loss]")
    assert chart_points(page, "loss") == sum(counts)  # both jobs' curves on one chart
    legend = page.eval_on_selector_all("[data-chart=loss] .chart-legend .series", "els => els.map(e => e.innerText)")
    assert any("long-run" in text for text in legend) and any("from-the-dashboard" in text for text in legend)
    diff = page.locator("[data-diff]")
    expect(diff).to_contain_text("training.num_train_epochs")
    expect(diff).to_contain_text("300")
    shot(page, "08-compare")
    # Back in the list, the finished job has its loss sparkline.
    page.click("#nav a[data-view=jobs]")
    expect(page.locator(f"tr[data-job-id='{jobs['submitted']}'] svg.spark polyline")).to_have_count(1)
    # Every job here has ended: a poll of the list keeps each row (and its "pick for compare" box).
    assert_a_poll_keeps(page, f"tr[data-job-id='{jobs['submitted']}']", "/v1/jobs")
    shot(page, "11-job-list-later")


def test_a_multi_node_jobs_page_shows_its_gang(page: Page, dev: DevService, files: dict[str, str], shot: Shot) -> None:
    """A job of two nodes whose gang is forming (rows as worker/gang.py writes them; held, so the one
    worker of `trainjobs dev` never takes it): the job page says why it has not started and lists each
    joined slot's host and worker."""
    from service_core.db.base import utcnow
    from service_core.db.models import Job, JobNode
    from service_core.db.session import session_scope
    from service_core.settings import Settings

    settings = Settings.model_validate({"TRAINJOBS_HOME": str(dev.home)})
    with session_scope(settings.database_url) as session:
        spec = {**tiny(files, "two-nodes", epochs=1), "resources": {"num_nodes": 2}}
        job = Job(owner="alice", name="two-nodes", spec=spec, nodes=2, waiting_reason="waiting: needs 2 nodes",
                  enqueued_at=None)  # fmt: skip
        session.add(job)
        session.flush()
        for host, address in (("gpu-a", "10.0.0.5"), ("gpu-b", "10.0.0.6")):
            session.add(JobNode(job_id=job.id, slot=f"{host}-41", worker=f"{host}-40", host=host, pid=41, attempt=1,
                                address=address, port=29400, lease_expires_at=utcnow()))  # fmt: skip
        job_id = job.id
    log_in(page, dev, f"#/jobs/{job_id}")
    nodes = page.locator("[data-nodes] dd")
    expect(nodes).to_have_count(2)
    expect(nodes.nth(0)).to_contain_text("gpu-a")
    expect(nodes.nth(1)).to_contain_text("gpu-b-40, reached at 10.0.0.6")
    expect(page.locator("[data-waiting]")).to_contain_text("waiting: needs 2 nodes")
    shot(page, "09-job-nodes")
