"""A run's summary (the job's final metrics) has the same keys whichever backend trained it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.trainer_core.runhelpers import BACKENDS, done_event, run, text_spec

TRAIN_KEYS = {"train_runtime_s", "train_samples", "train_samples_per_second", "train_loss"}


def summary_of(tmp_path: Path, backend: str, **kwargs: Any) -> dict[str, Any]:
    spec = text_spec(tmp_path / "data", backend, n_train=16, n_val=8,
                     training={"max_steps": 3, "per_device_train_batch_size": 4, "logging_steps": 1})
    status, events = run(spec, tmp_path / f"out-{backend}-{len(kwargs)}", **kwargs)
    summary: dict[str, Any] = done_event(events)["summary"]
    summary["status"] = status
    return summary


def test_both_backends_report_the_same_final_metric_keys(tmp_path: Path) -> None:
    done = {backend: summary_of(tmp_path, backend) for backend in BACKENDS}
    for summary in done.values():
        assert summary["status"] == "succeeded"
        assert set(summary["train"]) == TRAIN_KEYS
        assert summary["train"]["train_samples"] == 12  # 3 steps x 4 samples, counted the same way
        assert summary["train"]["train_loss"] > 0
    # What the worker stores as final_metrics: the train summary and the final evaluation, flat.
    keys = {b: set(s["train"]) | set(s["eval"]) for b, s in done.items()}
    assert keys["trainer"] == keys["accelerate"]


def test_a_cancelled_run_reports_the_same_train_keys(tmp_path: Path) -> None:
    stop = tmp_path / "stop"
    stop.touch()
    for backend in BACKENDS:
        summary = summary_of(tmp_path, backend, stop_file=stop)
        assert summary["status"] == "cancelled" and set(summary["train"]) == TRAIN_KEYS
        assert summary["train"]["train_samples"] == 4  # one step, then the stop
