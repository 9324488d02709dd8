"""Structured logs: JSON lines off a terminal, with the job id on every line logged for a job."""

from __future__ import annotations

import io
import json
import logging
import sys
import threading
from collections.abc import Iterator

import pytest

from service_core.logging import configure_logging, job_context


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> Iterator[io.StringIO]:
    stream = io.StringIO()  # not a TTY, so the default must be JSON
    monkeypatch.setattr(sys, "stderr", stream)
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    configure_logging()
    yield stream
    root.handlers, root.level = saved[0], saved[1]


def test_json_lines_carry_the_job_id_inside_job_context_only(captured: io.StringIO) -> None:
    log = logging.getLogger("worker.test")
    log.info("before")
    with job_context("job123"):
        log.warning("during %d", 1)
        logging.getLogger("trainer_core.any").info("from another module")
    log.info("after")
    lines = [json.loads(line) for line in captured.getvalue().splitlines()]
    assert [line["message"] for line in lines] == ["before", "during 1", "from another module", "after"]
    assert [line.get("job_id") for line in lines] == [None, "job123", "job123", None]
    assert lines[1]["level"] == "WARNING" and lines[1]["logger"] == "worker.test"


def test_exceptions_are_one_json_line(captured: io.StringIO) -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("x").exception("failed")
    (line,) = captured.getvalue().splitlines()
    entry = json.loads(line)
    assert entry["message"] == "failed" and "ValueError: boom" in entry["exc"]


def test_text_format_on_request(captured: io.StringIO) -> None:
    configure_logging(json=False, stream=captured)
    with job_context("abc"):
        logging.getLogger("w").info("hello")
    text = captured.getvalue()
    assert "[job abc] hello" in text and not text.startswith("{")


def test_process_wide_context_reaches_threads_started_inside(captured: io.StringIO) -> None:
    def work() -> None:
        logging.getLogger("worker.supervisor").info("reader thread")

    with job_context("slotjob", process_wide=True):
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
    work()
    lines = [json.loads(line) for line in captured.getvalue().splitlines()]
    assert [line.get("job_id") for line in lines] == ["slotjob", None]
