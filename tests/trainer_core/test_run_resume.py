"""Through the CLI: a run SIGKILLed mid-way and resumed ends where an uninterrupted run ends; SIGTERM cancels."""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

import pytest

from tests.trainer_core.runhelpers import (
    BACKENDS,
    assert_same_weights,
    cli_process,
    done_event,
    events_until,
    finish,
    run,
    text_spec,
    write_spec,
)
from trainer_core.checkpoint import complete_checkpoints
from trainer_core.spec import JobSpec

pytestmark = pytest.mark.usefixtures("warm_runs")  # the CLI runs fork from a zygote (tests/conftest.py)

TOTAL_STEPS = 40


def resumable_spec(tmp_path: Path, backend: str) -> JobSpec:
    # Dropout stays on: resuming must restore the RNG, not only the weights and the optimizer.
    return text_spec(
        tmp_path / "data", backend, n_train=64,
        training={"max_steps": TOTAL_STEPS, "per_device_train_batch_size": 8, "save_steps": 5,
                  "logging_steps": 5, "learning_rate": 3e-3},
    )


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_sigkilled_run_resumed_matches_an_uninterrupted_run(tmp_path: Path, backend: str) -> None:
    spec = resumable_spec(tmp_path, backend)
    status, _ = run(spec, tmp_path / "reference")
    assert status == "succeeded"

    spec_file = write_spec(spec, tmp_path / "spec.json")
    out = tmp_path / "out"
    proc = cli_process(str(spec_file), "--output-dir", str(out), "--jsonl")
    try:
        events_until(proc, stop_at_step=12)
        proc.send_signal(signal.SIGKILL)  # SIGKILL: no handler runs, nothing is flushed
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    steps = [int(p.name.split("-")[1]) for p in complete_checkpoints(out)]
    assert steps and max(steps) < TOTAL_STEPS, steps  # really killed mid-way
    assert not (out / "metrics.json").exists()

    resumed = cli_process(str(spec_file), "--output-dir", str(out), "--jsonl", "--resume")
    events = finish(resumed)
    assert resumed.returncode == 0
    progress = [e["step"] for e in events if e["event"] == "progress"]
    assert progress == list(range(max(steps) + 1, TOTAL_STEPS + 1))  # no batch trained twice
    assert events[-1]["event"] == "done" and events[-1]["status"] == "succeeded"
    assert_same_weights(tmp_path / "reference", out, atol=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_sigterm_finishes_the_step_writes_a_checkpoint_and_exits_cancelled(tmp_path: Path, backend: str) -> None:
    spec = resumable_spec(tmp_path, backend)
    spec_file = write_spec(spec, tmp_path / "spec.json")
    out = tmp_path / "out"
    proc = cli_process(str(spec_file), "--output-dir", str(out), "--jsonl")
    try:
        before = events_until(proc, stop_at_step=3)
        proc.send_signal(signal.SIGTERM)
        after = finish(proc)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 3  # a cancelled run exits 3 (trainer_core.events.RUN_EXIT_CODES)
    done = after[-1]
    assert done["event"] == "done" and done["status"] == "cancelled"
    stopped_at = done["summary"]["global_step"]
    assert before[-1]["step"] <= stopped_at < TOTAL_STEPS
    assert f"checkpoint-{stopped_at}" in [p.name for p in complete_checkpoints(out)]


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_from_a_checkpoint_at_the_last_step_trains_no_extra_step(tmp_path: Path, backend: str) -> None:
    # The run was killed after its last checkpoint and before it reported done.
    spec = text_spec(tmp_path / "data", backend, n_train=32,
                     training={"max_steps": 10, "per_device_train_batch_size": 8, "save_steps": 5})  # fmt: skip
    status, _ = run(spec, tmp_path / "out")
    assert status == "succeeded"
    assert "checkpoint-10" in [p.name for p in complete_checkpoints(tmp_path / "out")]
    shutil.copytree(tmp_path / "out", tmp_path / "reference")
    (tmp_path / "out" / "metrics.json").unlink()

    status, events = run(spec, tmp_path / "out", resume=True)
    assert status == "succeeded"
    assert [e for e in events.events if e["event"] == "progress"] == []  # was [11] with Trainer: 11/10
    assert done_event(events)["summary"]["global_step"] == 10
    assert_same_weights(tmp_path / "reference", tmp_path / "out", atol=0)
