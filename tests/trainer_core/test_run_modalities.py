"""Image and audio classification train end to end on generated files and clearly beat chance."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer_core import datagen
from tests.trainer_core.runhelpers import BACKENDS, done_event, evaluate_saved, run
from trainer_core.spec import parse_spec


@pytest.mark.parametrize("backend", BACKENDS)
def test_image_classifier_beats_chance(tmp_path: Path, backend: str) -> None:
    root = datagen.write_image_folder(tmp_path / "images", n_train_per_class=16, n_val_per_class=6)
    spec = parse_spec(datagen.tiny_image_spec(root, training={"backend": backend, "num_train_epochs": 4}))
    status, events = run(spec, tmp_path / "out")
    assert status == "succeeded", done_event(events)
    accuracy = done_event(events)["summary"]["eval"]["eval_accuracy"]
    assert accuracy >= 0.8  # three classes: chance is 1/3
    assert evaluate_saved(spec, tmp_path / "out")["eval_accuracy"] == pytest.approx(accuracy)


@pytest.mark.parametrize("backend", BACKENDS)
def test_audio_classifier_beats_chance(tmp_path: Path, backend: str) -> None:
    root = datagen.write_audio_folder(tmp_path / "audio", n_train_per_class=12, n_val_per_class=6)
    spec = parse_spec(datagen.tiny_audio_spec(root, training={"backend": backend, "num_train_epochs": 4}))
    status, events = run(spec, tmp_path / "out")
    assert status == "succeeded", done_event(events)
    accuracy = done_event(events)["summary"]["eval"]["eval_accuracy"]
    assert accuracy >= 0.8  # two classes: chance is 1/2
    assert evaluate_saved(spec, tmp_path / "out")["eval_accuracy"] == pytest.approx(accuracy)
