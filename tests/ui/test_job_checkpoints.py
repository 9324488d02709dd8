"""The job page's checkpoints in Chromium against a live ``trainjobs dev`` (issue 26): the checkpoints
tab lists what ``GET /v1/jobs/{id}/checkpoints`` lists with the API's best badged, a download is the
zip, a checkpoint completed during the run appears without a reload or a poll, and the loss and eval
charts mark each checkpoint's step, the best one apart."""

from __future__ import annotations

import json
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import Page, Request, expect

from tests.trainer_core.datagen import tiny_text_spec, write_sentiment_csv
from tests.ui.conftest import DevService, log_in, wait_for_job
from trainjobs.client import Client

pytestmark = pytest.mark.slow
Shot = Callable[..., Path]


@pytest.fixture(scope="module")
def files(dev: DevService) -> dict[str, str]:
    return write_sentiment_csv(dev.data_root / "sentiment-checkpoints", n_train=96, n_val=32)


def spec(files: dict[str, str], name: str, **training: Any) -> dict[str, Any]:
    training = {"logging_steps": 1, "eval_strategy": "steps", **training}
    return tiny_text_spec(files, name=name, training=training, preprocessing={"max_length": 32})


def client(dev: DevService) -> Client:
    return Client(dev.url, dev.key, timeout=120)  # a fresh service's first submit loads the preflight's libraries


def checkpoints(dev: DevService, job_id: str) -> dict[str, Any]:
    return client(dev)._json("GET", f"/v1/jobs/{job_id}/checkpoints")


@pytest.fixture(scope="module")
def finished(dev: DevService, files: dict[str, str]) -> str:
    """Six steps, evaluated and saved every second one: checkpoints at steps 2, 4 and 6."""
    job_id = client(dev).submit(spec(files, "checkpoints-done", max_steps=6, eval_steps=2, save_steps=2))["id"]
    job = wait_for_job(client(dev), job_id, lambda j: j["finished_at"] is not None, timeout=300)
    assert job["status"] == "succeeded", job["error"]
    return job_id


def open_tab(page: Page, dev: DevService, job_id: str) -> None:
    log_in(page, dev, f"#/jobs/{job_id}/checkpoints")
    page.wait_for_selector("[data-charts-ready]")


def test_the_tab_lists_every_checkpoint_with_the_apis_best_badged(
    page: Page, dev: DevService, finished: str, shot: Shot
) -> None:
    listed = checkpoints(dev, finished)
    steps = [item["step"] for item in listed["items"]]
    assert steps[:3] == [2, 4, 6], steps
    open_tab(page, dev, finished)
    table = page.locator("table.checkpoints")
    expect(table).to_have_attribute("data-checkpoints", str(len(steps)))
    rows = table.locator("tbody tr")
    assert rows.evaluate_all("rs => rs.map(r => +r.dataset.checkpoint)") == steps
    best = [item for item in listed["items"] if item["is_best"]]
    assert len(best) == 1
    expect(table.locator("tr[data-best]")).to_have_count(1)
    expect(table.locator("tr[data-best]")).to_have_attribute("data-checkpoint", str(best[0]["step"]))
    expect(table.locator("tr[data-best] .badge.best")).to_have_text("best")
    expect(table.locator(".badge.best")).to_have_count(1)
    for item in listed["items"]:
        row = table.locator(f"tr[data-checkpoint='{item['step']}']")
        expect(row.locator("[data-kept]")).to_have_attribute("data-kept", str(item["kept"]).lower())
        expect(row.locator("[data-metric=eval_loss] b")).to_have_count(1)  # the evaluation at its step
        expect(row).to_contain_text("KiB" if item["size"] < 2**20 else "MiB")  # size, human readable
        expect(row.locator("a[data-download]").first).to_have_attribute("href", item["download_url"])
    shot(page, "12-job-checkpoints")


def test_a_download_link_fetches_the_zip(page: Page, dev: DevService, finished: str, tmp_path: Path) -> None:
    open_tab(page, dev, finished)
    first = checkpoints(dev, finished)["items"][0]
    with page.expect_response(lambda r: r.url.endswith(first["download_url"])) as answer, page.expect_download() as got:
        page.locator(f"tr[data-checkpoint='{first['step']}'] a[data-download]").first.click()
    assert answer.value.status == 200
    assert answer.value.headers["content-type"] == "application/zip"
    saved = tmp_path / got.value.suggested_filename
    got.value.save_as(saved)
    assert saved.name == f"{finished}-checkpoint-{first['step']}.zip"
    with zipfile.ZipFile(saved) as archive:
        names = archive.namelist()
    assert names and all(n.startswith(f"checkpoint-{first['step']}/") for n in names), names
    assert not [n for n in names if n.split("/")[1].startswith("optimizer")], names  # not asked for


def test_the_loss_and_eval_charts_mark_each_checkpoint_and_the_best_apart(
    page: Page, dev: DevService, finished: str, shot: Shot
) -> None:
    listed = checkpoints(dev, finished)
    steps = [item["step"] for item in listed["items"]]
    best = next(item["step"] for item in listed["items"] if item["is_best"])
    log_in(page, dev, f"#/jobs/{finished}")
    for name in ("loss", "eval_loss", "eval_accuracy"):
        chart = page.locator(f"[data-chart={name}]")
        expect(chart).to_have_attribute("data-markers", json.dumps(steps, separators=(",", ":")))
        expect(chart).to_have_attribute("data-best-marker", str(best))
    # Not on the other charts: a checkpoint says nothing about the learning rate.
    expect(page.locator("[data-chart=learning_rate]")).to_have_attribute("data-markers", "[]")
    shot(page, "13-job-checkpoint-markers")


@pytest.fixture
def running(dev: DevService, files: dict[str, str], finished: str) -> Iterator[str]:
    """A long job saving every 24 steps (a few seconds apart); cancelled at the end. After `finished`,
    which would otherwise wait behind it for the one worker slot."""
    long_run = spec(files, "checkpoints-live", num_train_epochs=300, eval_steps=12, save_steps=24)
    job_id = client(dev).submit(long_run)["id"]
    yield job_id
    client(dev).cancel(job_id)
    wait_for_job(client(dev), job_id, lambda j: j["finished_at"] is not None, timeout=90)


def test_a_checkpoint_completed_during_the_run_appears_without_reload_or_polling(
    page: Page, dev: DevService, running: str
) -> None:
    lists: list[Request] = []
    page.on("request", lambda r: lists.append(r) if r.url.endswith(f"/v1/jobs/{running}/checkpoints") else None)
    open_tab(page, dev, running)  # while it is queued or starting: no checkpoint yet, most likely
    page.evaluate("window.sameDocument = true")
    table = "[data-checkpoints]"
    page.wait_for_selector(table)
    shown = int(page.get_attribute(table, "data-checkpoints") or 0)
    page.wait_for_function(f"() => +document.querySelector('{table}').dataset.checkpoints >= {shown + 2}",
                           timeout=240_000)  # fmt: skip
    assert page.evaluate("window.sameDocument") is True  # no reload
    rows = page.locator("table.checkpoints tbody tr").evaluate_all("rs => rs.map(r => +r.dataset.checkpoint)")
    listed = [item["step"] for item in checkpoints(dev, running)["items"]]
    assert rows == listed[: len(rows)] and rows[-1] % 24 == 0, (rows, listed)
    # Each list fetch after the first follows a checkpoint event: polling every few seconds would be more.
    assert len(lists) <= 1 + len(listed), [r.url for r in lists]
    # The charts mark the new checkpoints too.
    page.click("nav.tabs a[data-tab=charts]")
    page.wait_for_function(f"() => JSON.parse(document.querySelector('[data-chart=loss]').dataset.markers)"
                           f".includes({rows[-1]})")  # fmt: skip


def test_a_job_continued_from_a_checkpoint_links_both_ways(page: Page, dev: DevService, files: dict[str, str],
                                                           finished: str, shot: Shot) -> None:  # fmt: skip
    """``init_from``: the child's page links its parent at the checkpoint's step, and the parent's its child."""
    init_from = {"job": finished, "checkpoint": "best"}
    child_spec = {**spec(files, "continued", max_steps=1, eval_strategy="no"), "init_from": init_from}
    child = client(dev).submit(child_spec)["id"]
    done = wait_for_job(client(dev), child, lambda j: j["finished_at"] is not None, timeout=300)
    assert done["status"] == "succeeded", done["error"]
    (best,) = [item["step"] for item in checkpoints(dev, finished)["items"] if item["is_best"]]
    log_in(page, dev, f"#/jobs/{child}")
    parent = page.locator(f"[data-lineage] [data-started-from='{finished}']")
    expect(parent).to_contain_text(f"{finished} at checkpoint {best}")
    shot(page, "job-lineage", full_page=False)
    parent.locator("a").click()
    expect(page.locator(".job-header h2")).to_contain_text("checkpoints-done")
    children = page.locator("[data-lineage] [data-continued-by] a")
    expect(children).to_have_text([child])
    children.first.click()
    expect(page.locator(".job-header h2")).to_contain_text("continued")
