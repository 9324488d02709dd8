"""Checkpoints: every save_steps and at the end, self-describing, rotated; the stop file cancels cleanly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from tests.trainer_core.runhelpers import BACKENDS, assert_same_weights, done_event, run, text_spec, weights
from trainer_core.checkpoint import META_FILE, complete_checkpoints
from trainer_core.events import Event
from trainer_core.run import train_job

# What each backend writes besides model.safetensors and trainjobs' own description.
BACKEND_FILES = {
    "accelerate": {"optimizer.bin", "custom_checkpoint_0.pkl", "random_states_0.pkl"},  # pkl 0 = scheduler
    "trainer": {"optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"},
}


@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoints_every_save_steps_and_at_the_end_keeping_the_limit(tmp_path: Path, backend: str) -> None:
    spec = text_spec(
        tmp_path / "data", backend, n_train=32,
        training={"max_steps": 10, "per_device_train_batch_size": 8, "save_steps": 4, "save_total_limit": 2},
    )
    status, events = run(spec, tmp_path / "out")
    assert status == "succeeded"
    # One checkpoint event per save (rotated ones too): its step, and the last loss logged at or before it.
    losses = {e["step"]: e["values"]["loss"] for e in events.of_kind("metric")}
    saved = events.of_kind("checkpoint")
    assert [e["step"] for e in saved] == [4, 8, 10]
    for event in saved:
        assert event["loss"] == ([v for s, v in sorted(losses.items()) if s <= event["step"]] or [None])[-1]
        assert isinstance(event["epoch"], float)
    # Saved at 4, 8 and 10 (the end); the limit of 2 keeps the newest two.
    kept = complete_checkpoints(tmp_path / "out")
    assert [p.name for p in kept] == ["checkpoint-8", "checkpoint-10"]
    for ckpt in kept:
        names = {p.name for p in ckpt.iterdir()}
        assert {"model.safetensors", META_FILE} | BACKEND_FILES[backend] <= names, names
        meta = json.loads((ckpt / META_FILE).read_text())
        assert meta["global_step"] == int(ckpt.name.split("-")[1])
        assert meta["backend"] == backend
        assert meta["spec"] == spec.model_dump(mode="json")
    # The last checkpoint holds the final weights.
    assert_same_weights(tmp_path / "out", tmp_path / "out" / "checkpoint-10")
    # And loads on its own, tokenizer included (what a checkpoint download serves): the final weights.
    loaded = AutoModelForSequenceClassification.from_pretrained(kept[-1]).state_dict()
    for name, tensor in weights(tmp_path / "out").items():
        torch.testing.assert_close(loaded[name], tensor, msg=f"parameter {name} differs")
    assert AutoTokenizer.from_pretrained(kept[-1])("a fine film")["input_ids"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_stop_file_finishes_the_step_checkpoints_and_cancels_then_resume_completes(
    tmp_path: Path, backend: str
) -> None:
    spec = text_spec(
        tmp_path / "data", backend, n_train=32,
        training={"max_steps": 10, "per_device_train_batch_size": 8, "save_steps": 100},
    )
    stop_file = tmp_path / "STOP"
    seen: list[Event] = []

    def emit(event: Event) -> None:
        seen.append(event)
        if event["event"] == "progress" and event["step"] == 3:
            stop_file.touch()  # asked during step 3: the run must stop right after it

    out = tmp_path / "out"
    status = train_job(spec, out, emit=emit, stop_file=stop_file)
    assert status == "cancelled"
    assert seen[-1]["event"] == "done" and seen[-1]["status"] == "cancelled"
    assert seen[-1]["summary"]["global_step"] == 3
    assert [e["step"] for e in seen if e["event"] == "progress"] == [1, 2, 3]
    assert [p.name for p in complete_checkpoints(out)] == ["checkpoint-3"]
    assert not (out / "metrics.json").exists()  # no final model for a cancelled run

    stop_file.unlink()
    resumed_status, events = run(spec, out, resume=True, stop_file=stop_file)
    assert resumed_status == "succeeded"
    assert [e["step"] for e in events.of_kind("progress")] == list(range(4, 11))
    assert done_event(events)["summary"]["global_step"] == 10
