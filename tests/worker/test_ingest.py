"""Run events become rows in order: job events with monotonic seqs, one metric point per value
sharing its event's seq, throttled progress rows that always keep the last one, live job fields."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session

from service_core.db import JobEvent, MetricPoint
from service_core.db.session import session_scope
from service_core.settings import Settings
from trainer_core.events import make_event, parse_event_line
from worker.execute import session_factory
from worker.ingest import EventIngestor

from .conftest import JobFactory, load_job


def feed(ingestor: EventIngestor, events: list[dict[str, Any]]) -> None:
    """What the supervisor does with a run's events: add, flush when due, flush the rest at the end."""
    for event in events:
        ingestor.add(event)
        if ingestor.due():
            ingestor.flush()
    ingestor.flush(final=True)


def stored(settings: Settings, job_id: str) -> tuple[list[JobEvent], list[MetricPoint]]:
    """The job's event rows by seq, and its metric points by (seq, name)."""
    with session_scope(settings.database_url) as s:
        rows = s.execute(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.seq)).scalars().all()
        points = s.execute(
            select(MetricPoint).where(MetricPoint.job_id == job_id).order_by(MetricPoint.seq, MetricPoint.name)
        ).scalars().all()
    return list(rows), list(points)


RECORDED_RUN = Path(__file__).parent / "data" / "tiny_run_events.jsonl"  # stdout of a real 8-step run


def test_a_recorded_run_is_ingested_in_order(db_settings: Settings, make_job: JobFactory) -> None:
    job_id = make_job(db_settings)
    ingestor = EventIngestor(job_id, session_factory(db_settings))  # default batching and throttling
    lines = RECORDED_RUN.read_text().splitlines()
    recorded = [json.loads(line) for line in lines]
    events = [parse_event_line(line) for line in lines]
    feed(ingestor, [e for e in events if e is not None])
    assert None not in events

    rows, points = stored(db_settings, job_id)
    assert [r.seq for r in rows] == list(range(1, len(rows) + 1))
    assert "done" not in {r.kind for r in rows}  # the supervisor turns it into the status
    progress = [r.data["step"] for r in rows if r.kind == "progress"]
    assert progress[-1] == 8 and progress == sorted(progress)  # throttled, last kept
    want = [(e["step"], name, value) for e in recorded if e["event"] in ("metric", "eval")
            for name, value in sorted(e["values"].items())]  # fmt: skip
    assert [(p.step, p.name, p.value) for p in points] == want
    job = load_job(db_settings, job_id)
    assert (job.progress_step, job.progress_total) == (8, 8)
    assert job.measured_memory == next(e["values"] for e in recorded if e["event"] == "memory")


def recorded_stream(steps: int) -> list[dict[str, Any]]:
    """The shape of a real run's stdout: memory, then progress + metric per step, eval, log."""
    events = [make_event("memory", values={"parameter_bytes": 800, "gradient_bytes": 800,
                                           "optimizer_state_bytes": 1600, "peak_allocated_bytes": None})]
    for step in range(1, steps + 1):
        events.append(make_event("progress", step=step, total_steps=steps, epoch=step / steps))
        events.append(make_event("metric", step=step, epoch=step / steps,
                                 values={"loss": 1.0 / step, "learning_rate": 1e-3, "grad_norm": float("nan")}))
    events.append(make_event("eval", step=steps, epoch=1.0, values={"eval_loss": 0.5, "eval_accuracy": 0.75}))
    events.append(make_event("log", level="info", message="saved model"))
    return events


def test_stream_is_stored_in_order_with_shared_seqs(db_settings: Settings, make_job: JobFactory) -> None:
    job_id = make_job(db_settings)
    ingestor = EventIngestor(job_id, session_factory(db_settings), max_batch=7, progress_rows_per_s=0)
    feed(ingestor, recorded_stream(20))

    rows, points = stored(db_settings, job_id)
    seqs = [r.seq for r in rows]
    assert seqs == list(range(1, len(rows) + 1))  # written in order, no gaps
    assert [r.kind for r in rows[:3]] == ["memory", "progress", "metric"]
    assert [r.kind for r in rows[-2:]] == ["eval", "log"]
    kind_of = {r.seq: r.kind for r in rows}
    # 20 metric events x 3 values + 1 eval event x 2 values, each point under its event's seq
    assert len(points) == 62
    assert {kind_of[p.seq] for p in points} == {"metric", "eval"}
    losses = [p for p in points if p.name == "loss"]
    assert [p.step for p in losses] == list(range(1, 21))
    assert [p.value for p in losses] == [1.0 / s for s in range(1, 21)]
    assert all(p.value is None for p in points if p.name == "grad_norm")  # NaN stored as null
    job = load_job(db_settings, job_id)
    assert job.last_seq == seqs[-1]
    assert (job.progress_step, job.progress_total, job.epoch) == (20, 20, 1.0)
    assert job.measured_memory == {"parameter_bytes": 800, "gradient_bytes": 800,
                                   "optimizer_state_bytes": 1600, "peak_allocated_bytes": None}
    assert job.latest_metrics is not None
    assert job.latest_metrics["loss"] == 1.0 / 20 and job.latest_metrics["eval_accuracy"] == 0.75


def test_progress_rows_are_throttled_but_the_last_is_kept(db_settings: Settings, make_job: JobFactory) -> None:
    job_id = make_job(db_settings)
    ingestor = EventIngestor(job_id, session_factory(db_settings), progress_rows_per_s=5)
    started = time.monotonic()
    for step in range(1, 201):  # 200 steps in well under a second: a fast run
        ingestor.add(make_event("progress", step=step, total_steps=200, epoch=step / 200))
        if ingestor.due():
            ingestor.flush()
    ingestor.flush(final=True)
    elapsed = time.monotonic() - started

    with session_scope(db_settings.database_url) as s:
        steps = s.execute(
            select(JobEvent.data).where(JobEvent.job_id == job_id, JobEvent.kind == "progress").order_by(JobEvent.seq)
        ).scalars().all()
    stored = [d["step"] for d in steps]
    assert stored[0] == 1 and stored[-1] == 200  # first and last always there
    assert stored == sorted(stored)
    assert len(stored) <= 2 + int(elapsed * 5) + 1  # at most ~5 rows per second
    assert len(stored) < 200
    assert load_job(db_settings, job_id).progress_step == 200


def test_held_progress_goes_out_before_later_events(db_settings: Settings, make_job: JobFactory) -> None:
    job_id = make_job(db_settings)
    ingestor = EventIngestor(job_id, session_factory(db_settings), progress_rows_per_s=1)
    ingestor.add(make_event("progress", step=1, total_steps=3, epoch=0.3))
    ingestor.add(make_event("progress", step=2, total_steps=3, epoch=0.6))  # throttled, held
    ingestor.add(make_event("metric", step=2, epoch=0.6, values={"loss": 0.4}))
    ingestor.flush(final=True)
    with session_scope(db_settings.database_url) as s:
        rows = s.execute(select(JobEvent).where(JobEvent.job_id == job_id).order_by(JobEvent.seq)).scalars().all()
    assert [(r.kind, r.data.get("step")) for r in rows] == [("progress", 1), ("progress", 2), ("metric", 2)]


def test_a_write_that_committed_before_its_connection_died_is_not_stored_twice(
    db_settings: Settings, make_job: JobFactory
) -> None:
    """The database committed the batch, then the connection died before the worker heard so (chaos
    R7 saw one loss point twice). The retry must find the batch stored and not write it again; a
    batch whose transaction really failed is still written on the next try."""
    job_id = make_job(db_settings, {"name": "commit-then-lost"})
    real = session_factory(db_settings)
    lose_after_commit = {"on": False}

    @contextmanager
    def factory() -> Iterator[Session]:
        with real() as session:
            yield session
        if lose_after_commit["on"]:  # the COMMIT above went through; its answer is what got lost
            raise OperationalError("COMMIT", {}, ConnectionError("server closed the connection"))

    ingestor = EventIngestor(job_id, factory, progress_rows_per_s=0)
    ingestor.add(make_event("metric", step=1, values={"loss": 1.0}))
    assert ingestor.flush() == 1
    lose_after_commit["on"] = True
    ingestor.add(make_event("metric", step=2, values={"loss": 0.5}))
    ingestor.add(make_event("log", message="same batch"))
    with pytest.raises(OperationalError):
        ingestor.flush()
    lose_after_commit["on"] = False
    ingestor.add(make_event("metric", step=3, values={"loss": 0.25}))
    assert ingestor.flush() == 3  # the uncertain batch (found stored) and the new event
    rows, points = stored(db_settings, job_id)
    assert [(r.kind, r.data.get("step")) for r in rows] == [("metric", 1), ("metric", 2), ("log", None), ("metric", 3)]
    assert [p.step for p in points] == [1, 2, 3]

    # A transaction that did not commit (it failed inside) is written on the retry, once.
    ingestor.add(make_event("metric", step=4, values={"loss": 0.125}))
    ingestor.pending.append({"event": "metric", "step": "not-a-number", "values": {}})  # fails in _write
    with pytest.raises(ValueError):
        ingestor.flush()
    ingestor.pending.pop()
    assert ingestor.flush() == 1
    assert [p.step for p in stored(db_settings, job_id)[1]] == [1, 2, 3, 4]


def test_a_committed_batch_is_not_stored_twice_when_the_next_try_fails_before_it_looks(
    db_settings: Settings, make_job: JobFactory
) -> None:
    """The batch committed but its answer was lost; the next try could not even connect (the outage
    goes on) while more events came in. The try after that must still find the first batch stored
    and write only what came after it (a run through a database outage stored loss step 19 twice)."""
    job_id = make_job(db_settings, {"name": "commit-lost-then-down"})
    real = session_factory(db_settings)
    fault = {"mode": ""}

    @contextmanager
    def factory() -> Iterator[Session]:
        if fault["mode"] == "down":  # nothing reaches the server: not even the check runs
            raise OperationalError("connect", {}, ConnectionRefusedError("connection refused"))
        with real() as session:
            yield session
        if fault["mode"] == "lost-answer":
            raise OperationalError("COMMIT", {}, ConnectionError("server closed the connection"))

    ingestor = EventIngestor(job_id, factory, progress_rows_per_s=0)
    ingestor.add(make_event("metric", step=1, values={"loss": 1.0}))
    fault["mode"] = "lost-answer"
    with pytest.raises(OperationalError):
        ingestor.flush()
    fault["mode"] = "down"
    for step in (2, 3):
        ingestor.add(make_event("metric", step=step, values={"loss": 1.0 / step}))
        with pytest.raises(OperationalError):
            ingestor.flush()
    fault["mode"] = ""
    assert ingestor.flush() == 3  # step 1 found stored, steps 2 and 3 written
    assert [p.step for p in stored(db_settings, job_id)[1]] == [1, 2, 3]
    assert ingestor.pending == [] and ingestor.unsure == 0
