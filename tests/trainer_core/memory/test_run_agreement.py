"""The estimate's optimizer state equals, to the byte, what real runs report in their memory event."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.trainer_core import datagen
from tests.trainer_core.runhelpers import BACKENDS, done_event, run
from trainer_core.memory import estimate_memory
from trainer_core.spec import JobSpec, parse_spec

# hidden 64 so the 64x128 MLP matrices take bnb's 8-bit path (>= 4096 elements)
WIDER = {"hidden_size": 64, "intermediate_size": 128}
SHORT = {"max_steps": 1, "logging_steps": 1, "eval_strategy": "no", "per_device_train_batch_size": 8}


def run_memory_event(spec: JobSpec, output_dir: Path) -> dict[str, Any]:
    status, events = run(spec, output_dir)
    assert status == "succeeded", done_event(events)
    (memory,) = events.of_kind("memory")
    values: dict[str, Any] = memory["values"]
    return values


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("optimizer", ["adamw", "adafactor", "adamw_8bit"])
def test_text_runs_match_the_estimate(tmp_path: Path, backend: str, optimizer: str) -> None:
    files = datagen.write_sentiment_csv(tmp_path / "data", n_train=16, n_val=8)
    spec = parse_spec(
        datagen.tiny_text_spec(
            files,
            model={"config": WIDER},
            optimizer={"name": optimizer},
            training={"backend": backend, **SHORT},
            efficiency={"mixed_precision": "bf16" if optimizer == "adamw_8bit" else "no"},
        )
    )
    values = run_memory_event(spec, tmp_path / "out")
    estimate = estimate_memory(spec, num_labels=2)  # positive / negative
    assert values["optimizer_state_bytes"] == estimate.optimizer_state_bytes
    assert values["parameter_bytes"] == estimate.parameter_bytes
    assert values["gradient_bytes"] == estimate.gradient_bytes


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("optimizer", ["adamw", "adafactor", "adamw_8bit"])
@pytest.mark.parametrize("modality", ["image", "audio"])
def test_image_and_audio_runs_match_the_estimate(tmp_path: Path, modality: str, optimizer: str, backend: str) -> None:
    sections = {
        "model": {"config": WIDER},
        "optimizer": {"name": optimizer},
        "training": {"backend": backend, **SHORT},
    }
    if modality == "image":
        data = datagen.write_image_folder(tmp_path / "data")
        spec, labels = parse_spec(datagen.tiny_image_spec(data, **sections)), 3  # red / green / blue
    else:
        data = datagen.write_audio_folder(tmp_path / "data")
        spec, labels = parse_spec(datagen.tiny_audio_spec(data, **sections)), 2  # low / high
    values = run_memory_event(spec, tmp_path / "out")
    assert values["optimizer_state_bytes"] == estimate_memory(spec, num_labels=labels).optimizer_state_bytes


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("kind", ["full", "lora", "qlora"])
@pytest.mark.parametrize("optimizer", ["adamw", "adafactor", "adamw_8bit"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_lm_runs_match_the_estimate(tmp_path: Path, backend: str, optimizer: str, kind: str, arch: str) -> None:
    """Parameters (a 4-bit base with its quantisation state), gradients and optimizer state of the live
    model after its first step, as the memory event reports them, equal the estimate."""
    from tests.trainer_core.llm_runs import counting_data, llm_spec, run_llm

    # r 16: down_proj's lora_A (16 x 256) is large enough for bnb's 8-bit state, the rest stays 32-bit
    adapter = {} if kind == "full" else {"adapter": {"r": 16}}
    spec = llm_spec(
        arch, kind, backend, optimizer={"name": optimizer},
        training={"max_steps": 1, "logging_steps": 1, "eval_strategy": "no"}, **adapter,
    )  # fmt: skip
    result, events = run_llm(spec, tmp_path / "out", counting_data(8, 0))
    assert result.status == "succeeded"
    (memory,) = events.of_kind("memory")
    values, estimate = memory["values"], estimate_memory(spec)
    assert values["parameter_bytes"] == estimate.parameter_bytes
    assert values["gradient_bytes"] == estimate.gradient_bytes
    assert values["optimizer_state_bytes"] == estimate.optimizer_state_bytes
