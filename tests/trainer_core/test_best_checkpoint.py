"""The best checkpoint (issue 26): retention keeps it beside the newest, ``load_best_model_at_end`` makes its
weights the final model with its evaluation as the final one, on both backends; the spec's refusals;
and the store's rotation keeps the best the run described."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.trainer_core.runhelpers import BACKENDS, assert_same_weights, done_event, run, text_spec
from trainer_core.best_checkpoint import BestCheckpoint, protected_step
from trainer_core.checkpoint import complete_checkpoints, read_meta
from trainer_core.spec import SpecError, TrainingSpec

# Evaluations and saves every 2 steps of 10; eval_loss counted *higher* as better, so the best is
# usually an early checkpoint (the loss falls as it trains) and rotation has something to spare.
TRAINING = {"max_steps": 10, "per_device_train_batch_size": 4, "eval_strategy": "steps", "eval_steps": 2,
            "logging_steps": 2, "save_steps": 2, "save_total_limit": 1, "greater_is_better": True,
            "learning_rate": 5e-3}  # fmt: skip


def best_of(evals: list[dict[str, Any]]) -> tuple[int, dict[str, float]]:
    """The highest eval_loss among the evaluations (checkpoints are at every evaluation), earliest on ties."""
    best = max(evals, key=lambda e: (e["values"]["eval_loss"], -e["step"]))
    return int(best["step"]), best["values"]


def test_the_rule_keeps_the_strictly_better_and_ignores_checkpoints_not_evaluated_at_their_step() -> None:
    best = BestCheckpoint(TrainingSpec(keep_best_checkpoint=True))  # eval_loss, lower is better
    best.saved(2, {"eval_loss": 0.9})
    best.saved(4, None)  # not evaluated at step 4: no candidate
    best.saved(6, {"eval_loss": 0.9})  # a tie keeps the earlier
    best.saved(8, {"eval_loss": float("nan")})
    assert (best.step, best.value, best.protected()) == (2, 0.9, 2)
    best.saved(10, {"eval_loss": 0.5, "eval_accuracy": 0.75})
    assert (best.step, best.evaluation) == (10, {"eval_loss": 0.5, "eval_accuracy": 0.75})
    assert BestCheckpoint(TrainingSpec()).protected() is None  # nobody asked to keep it


@pytest.mark.parametrize("backend", BACKENDS)
def test_retention_keeps_the_best_checkpoint_beside_the_newest(tmp_path: Path, backend: str) -> None:
    spec = text_spec(tmp_path / "data", backend, n_train=32, n_val=8,
                     training={**TRAINING, "keep_best_checkpoint": True})  # fmt: skip
    status, events = run(spec, tmp_path / "out")
    assert status == "succeeded"
    best_step, _ = best_of(events.of_kind("eval"))
    kept = {int(p.name.split("-")[1]) for p in complete_checkpoints(tmp_path / "out")}
    assert kept == {best_step, 10}
    assert read_meta(tmp_path / "out" / "checkpoint-10")["best_checkpoint"]["step"] == best_step
    # Not loaded: the final model is the last step's.
    assert_same_weights(tmp_path / "out", tmp_path / "out" / "checkpoint-10")


@pytest.mark.parametrize("backend", BACKENDS)
def test_load_best_model_at_end_exports_the_best_checkpoints_weights_and_evaluation(
    tmp_path: Path, backend: str
) -> None:
    spec = text_spec(tmp_path / "data", backend, n_train=32, n_val=8,
                     training={**TRAINING, "load_best_model_at_end": True})  # fmt: skip
    status, events = run(spec, tmp_path / "out")
    assert status == "succeeded"
    best_step, best_values = best_of(events.of_kind("eval"))
    assert best_step != 10, "the test needs a best checkpoint before the last step"
    assert_same_weights(tmp_path / "out", tmp_path / "out" / f"checkpoint-{best_step}")
    assert done_event(events)["summary"]["eval"] == pytest.approx(best_values)


@pytest.mark.parametrize(
    ("training", "field"),
    [
        ({"load_best_model_at_end": True, "eval_strategy": "epoch"}, "training.load_best_model_at_end"),
        ({"load_best_model_at_end": True, "eval_strategy": "steps", "eval_steps": 3, "save_steps": 4},
         "training.load_best_model_at_end"),
        ({"keep_best_checkpoint": True, "metric_for_best_model": "f1"}, "training.metric_for_best_model"),
    ],
)  # fmt: skip
def test_a_best_checkpoint_the_run_cannot_know_is_refused_naming_the_field(
    tmp_path: Path, training: dict[str, Any], field: str
) -> None:
    with pytest.raises(SpecError) as raised:
        text_spec(tmp_path / "data", "trainer", training=training)
    assert [e.field for e in raised.value.errors] == [field], str(raised.value)


def test_the_store_keeps_the_best_the_run_described(tmp_path: Path) -> None:
    meta = {"spec": {"training": {"keep_best_checkpoint": True}}, "best_checkpoint": {"step": 4}}
    assert protected_step(meta) == 4
    assert protected_step({**meta, "spec": {"training": {}}}) is None  # not asked: rotation as before
