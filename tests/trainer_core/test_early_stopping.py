"""Early stopping (issue 26): the rule of trainer_core/early_stopping.py, both backends stopping a real run
at the same evaluation with the final model saved, and the spec's refusals."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.trainer_core.runhelpers import BACKENDS, done_event, run, text_spec
from trainer_core.early_stopping import EarlyStopper
from trainer_core.spec import EarlyStoppingSpec, SpecError


def stops_at(spec: EarlyStoppingSpec, values: list[float | None]) -> int | None:
    """The evaluation (1-based) at which the stopper says stop, feeding ``values`` in order."""
    stopper = EarlyStopper(spec)
    for index, value in enumerate(values, start=1):
        if stopper.observe(index, {} if value is None else {spec.key: value}):
            return index
    return None


def test_patience_counts_evaluations_without_an_improvement_larger_than_min_delta() -> None:
    loss = EarlyStoppingSpec(patience=2, min_delta=0.01)
    assert stops_at(loss, [1.0, 0.9, 0.8, 0.7]) is None  # improving every time
    assert stops_at(loss, [1.0, 0.995, 0.992, 0.5]) == 3  # 0.005 and 0.008 better: not more than min_delta
    assert stops_at(loss, [1.0, 1.2, 0.5, 0.6, 0.7]) == 5  # an improvement resets the count
    assert stops_at(loss, [1.0, None, float("nan")]) == 3  # missing or not finite: no improvement
    accuracy = EarlyStoppingSpec(metric="accuracy", patience=1)
    assert accuracy.key == "eval_accuracy" and accuracy.higher_is_better
    assert stops_at(accuracy, [0.5, 0.6, 0.6]) == 3
    assert stops_at(EarlyStoppingSpec(metric="accuracy", patience=1, greater_is_better=False), [0.5, 0.6]) == 2


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_run_whose_metric_stops_improving_ends_early_and_succeeds(tmp_path: Path, backend: str) -> None:
    # min_delta far above any change: only the first evaluation counts as best, so with patience 2 the
    # run stops at its third evaluation, step 6 of 20.
    spec = text_spec(
        tmp_path / "data", backend, n_train=32, n_val=8,
        training={"max_steps": 20, "per_device_train_batch_size": 4, "eval_strategy": "steps", "eval_steps": 2,
                  "logging_steps": 2, "save_steps": 100},
        early_stopping={"metric": "eval_loss", "patience": 2, "min_delta": 1e6},
    )  # fmt: skip
    status, events = run(spec, tmp_path / "out")
    assert status == "succeeded"
    assert [e["step"] for e in events.of_kind("eval")] == [2, 4, 6]
    summary = done_event(events)["summary"]
    assert summary["global_step"] == 6
    assert summary["train"]["stopped_early"] is True and summary["train"]["stopped_at_step"] == 6
    assert (tmp_path / "out" / "model.safetensors").is_file()  # the final model, as at a normal end


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_run_that_keeps_improving_reports_it_did_not_stop_early(tmp_path: Path, backend: str) -> None:
    spec = text_spec(
        tmp_path / "data", backend, n_train=16, n_val=8,
        training={"max_steps": 4, "per_device_train_batch_size": 4, "eval_strategy": "steps", "eval_steps": 2},
        early_stopping={"patience": 5},
    )  # fmt: skip
    status, events = run(spec, tmp_path / "out")
    summary = done_event(events)["summary"]
    assert status == "succeeded" and summary["global_step"] == 4 and summary["train"]["stopped_early"] is False


@pytest.mark.parametrize(
    ("training", "early", "field"),
    [
        ({"eval_strategy": "no"}, {}, "early_stopping"),
        ({}, {"metric": "f1"}, "early_stopping.metric"),  # the spec's metrics are ["accuracy"]
        ({}, {"patience": 0}, "early_stopping.patience"),
        ({}, {"min_delta": -1}, "early_stopping.min_delta"),
    ],
)
def test_an_early_stopping_the_run_cannot_honour_is_refused_naming_the_field(
    tmp_path: Path, training: dict[str, str], early: dict[str, object], field: str
) -> None:
    with pytest.raises(SpecError) as raised:
        text_spec(tmp_path / "data", "trainer", training=training, early_stopping=early)
    assert [e.field for e in raised.value.errors] == [field], str(raised.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_resumed_run_stops_at_the_step_an_uninterrupted_one_does(tmp_path: Path, backend: str) -> None:
    # Evaluations at 2 (best), 4, 6, 8: patience 3 stops at 8. Resumed from the checkpoint at 4, the
    # count (one evaluation without improvement) comes with it; counted afresh it would stop at 12.
    spec = text_spec(
        tmp_path / "data", backend, n_train=32, n_val=8,
        training={"max_steps": 20, "per_device_train_batch_size": 4, "eval_strategy": "steps", "eval_steps": 2,
                  "logging_steps": 2, "save_steps": 2},
        early_stopping={"patience": 3, "min_delta": 1e6},
    )  # fmt: skip
    status, events = run(spec, tmp_path / "whole")
    assert status == "succeeded" and done_event(events)["summary"]["train"]["stopped_at_step"] == 8
    shutil.copytree(tmp_path / "whole" / "checkpoint-4", tmp_path / "resumed" / "checkpoint-4")
    status, events = run(spec, tmp_path / "resumed", resume=True)
    assert status == "succeeded"
    assert [e["step"] for e in events.of_kind("eval")] == [6, 8]
    assert done_event(events)["summary"]["train"]["stopped_at_step"] == 8
