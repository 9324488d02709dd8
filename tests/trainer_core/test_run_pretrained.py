"""The real pretrained MiniLM fine-tuned on a generated sentiment CSV reaches >= 0.9 accuracy, per backend."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer_core import datagen
from tests.trainer_core.runhelpers import BACKENDS, done_event, run
from trainer_core.spec import parse_spec


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_minilm_fine_tunes_to_90_percent(tmp_path: Path, minilm_path: Path, backend: str) -> None:
    files = datagen.write_sentiment_csv(tmp_path / "data", n_train=96, n_val=60)
    spec = parse_spec(datagen.tiny_text_spec(
        files, model_path=minilm_path,
        preprocessing={"max_length": 32},
        training={"backend": backend, "num_train_epochs": 2, "learning_rate": 1e-4, "eval_strategy": "no"},
    ))
    status, events = run(spec, tmp_path / "out")
    assert status == "succeeded", done_event(events)
    assert done_event(events)["summary"]["eval"]["eval_accuracy"] >= 0.9
