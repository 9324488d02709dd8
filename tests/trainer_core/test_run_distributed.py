"""Two processes on the CPU under torchrun (gloo): training finishes and eval metrics cover every rank."""

from __future__ import annotations

import logging
import signal
import threading
from pathlib import Path

import pytest

from tests.trainer_core.runhelpers import (
    cli_process,
    cli_run,
    done_event,
    evaluate_saved,
    events_until,
    finish,
    text_spec,
    write_spec,
)
from trainer_core.checkpoint import complete_checkpoints
from trainer_core.events import EventCollector
from trainer_core.run import train_job

pytestmark = pytest.mark.usefixtures("warm_runs")  # the CLI runs fork from a zygote (tests/conftest.py)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "local_sgd_steps", "forked"),
    [("accelerate", None, True), ("accelerate", 2, True), ("trainer", None, False)],
)
def test_two_processes_finish_and_report_gathered_metrics(
    tmp_path: Path, backend: str, local_sgd_steps: int | None, forked: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """``trainjobs train`` (a process of its own, with one thread) forks its ranks; a caller with a
    second thread alive (this test process, in-process) has torchrun start them as new interpreters:
    the same run either way."""
    # 31 validation rows: split over two ranks, one gets a padded duplicate that gathering must drop.
    spec = text_spec(
        tmp_path / "data", backend, n_train=64, n_val=31,
        training={"num_train_epochs": 2, "per_device_train_batch_size": 8, "learning_rate": 3e-3,
                  "logging_steps": 2},
        efficiency={"local_sgd_steps": local_sgd_steps},
        resources={"num_processes": 2},
    )
    if forked:
        status, events, logged = cli_run(spec, tmp_path / "out")
        launches = [line for line in logged.splitlines() if "the ranks are" in line or "torchrun starts" in line]
        assert len(launches) == 1 and launches[0].startswith("INFO the ranks are forks of this process"), launches
    else:
        caplog.set_level(logging.INFO, logger="trainer_core.launch")
        stop = threading.Event()
        thread = threading.Thread(target=stop.wait, name="caller's own")
        thread.start()
        events = EventCollector()
        try:
            status = train_job(spec, tmp_path / "out", emit=events)  # in this process: runhelpers.run would not
        finally:
            stop.set()
            thread.join()
        launches = [r.getMessage() for r in caplog.records if r.name == "trainer_core.launch"]
        assert len(launches) == 1 and launches[0].startswith("torchrun starts the ranks as new interpreters"), launches
    assert status == "succeeded", done_event(events)
    # Only rank 0 speaks: one memory event, one done event, each step reported once.
    assert len(events.of_kind("memory")) == 1
    steps = [e["step"] for e in events.of_kind("progress")]
    assert steps == list(range(1, 9))  # 64 rows / (8 x 2 ranks) = 4 steps per epoch
    final = done_event(events)["summary"]["eval"]
    # The reported metrics are those of the whole split, as a single process scores the saved model.
    reloaded = evaluate_saved(spec, tmp_path / "out")
    assert final["eval_accuracy"] == pytest.approx(reloaded["eval_accuracy"], abs=1e-9)
    assert final["eval_f1"] == pytest.approx(reloaded["eval_f1"], abs=1e-9)


@pytest.mark.slow
def test_sigterm_to_the_cli_stops_every_rank_at_one_step(tmp_path: Path) -> None:
    spec = text_spec(
        tmp_path / "data", "accelerate", n_train=64,
        training={"max_steps": 200, "per_device_train_batch_size": 8, "save_steps": 500},
        resources={"num_processes": 2},
    )
    proc = cli_process(str(write_spec(spec, tmp_path / "spec.json")), "--output-dir", str(tmp_path / "out"), "--jsonl")
    try:
        events_until(proc, stop_at_step=3)
        proc.send_signal(signal.SIGTERM)  # torchrun passes it on; the ranks agree on where to stop
        done = finish(proc)[-1]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 3  # cancelled (trainer_core.events.RUN_EXIT_CODES)
    assert done["event"] == "done" and done["status"] == "cancelled"
    stopped_at = done["summary"]["global_step"]
    assert 3 <= stopped_at < 200
    assert [p.name for p in complete_checkpoints(tmp_path / "out")] == [f"checkpoint-{stopped_at}"]
