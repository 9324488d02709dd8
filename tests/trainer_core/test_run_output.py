"""What a finished run leaves: model + tokenizer (safetensors), spec.json, metrics.json that reloading reproduces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.trainer_core.runhelpers import BACKENDS, done_event, evaluate_saved, run, text_spec
from trainer_core.spec import parse_spec


@pytest.mark.parametrize("backend", BACKENDS)
def test_output_dir_reloads_to_the_reported_final_metrics(tmp_path: Path, backend: str) -> None:
    spec = text_spec(
        tmp_path / "data", backend, n_train=64, n_val=30,
        training={"num_train_epochs": 3, "per_device_train_batch_size": 8, "learning_rate": 3e-3},
    )
    out = tmp_path / "out"
    status, events = run(spec, out)
    assert status == "succeeded"
    names = {p.name for p in out.iterdir()}
    assert {"model.safetensors", "config.json", "tokenizer.json", "spec.json", "metrics.json"} <= names
    assert not any(n.endswith(".bin") and n.startswith("pytorch_model") for n in names)
    assert parse_spec(json.loads((out / "spec.json").read_text())) == spec

    metrics = json.loads((out / "metrics.json").read_text())
    final = metrics["eval"]
    assert set(final) == {"eval_loss", "eval_accuracy", "eval_f1"}
    assert done_event(events)["summary"]["eval"] == final
    assert events.of_kind("eval")[-1]["values"] == final  # the last eval event is the final evaluation

    reloaded = evaluate_saved(spec, out)
    assert reloaded["eval_accuracy"] == pytest.approx(final["eval_accuracy"], abs=1e-9)
    assert reloaded["eval_f1"] == pytest.approx(final["eval_f1"], abs=1e-9)
    assert reloaded["eval_loss"] == pytest.approx(final["eval_loss"], abs=1e-4)
    # id2label survives the round trip, so predictions map back to the CSV's label names.
    config = json.loads((out / "config.json").read_text())
    assert set(config["id2label"].values()) == {"negative", "positive"}


def test_second_run_with_a_cache_dir_reuses_the_preprocessed_data(tmp_path: Path) -> None:
    spec = text_spec(tmp_path / "data", "accelerate", n_train=16, n_val=8, training={"max_steps": 1})
    hits = []
    for attempt in range(2):
        status, events = run(spec, tmp_path / f"out-{attempt}", cache_dir=tmp_path / "cache")
        assert status == "succeeded"
        hits.append(done_event(events)["summary"]["cache_hit"])
    assert hits == [False, True]
