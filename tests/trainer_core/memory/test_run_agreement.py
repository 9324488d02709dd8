"""The estimate's parameter, gradient and optimizer-state bytes equal, to the byte, what a run's memory
event reports for the live model and optimizer after their first step.

Each case builds the model and optimizer the way a run does and takes one optimizer step on a batch
of the run's data (tests/trainer_core/runhelpers.py:memory_after_one_step), with no run around it.
That both backends report exactly those values in their memory event is pinned by
tests/trainer_core/test_run_optimizers.py (text) and, here, by one QLoRA run per backend.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.trainer_core import datagen
from tests.trainer_core.runhelpers import BACKENDS, memory_after_one_step
from trainer_core.data import PreparedData, prepare_data
from trainer_core.memory import estimate_memory
from trainer_core.spec import JobSpec, parse_spec

# hidden 64 so the 64x128 MLP matrices take bnb's 8-bit path (>= 4096 elements)
WIDER = {"hidden_size": 64, "intermediate_size": 128}
SHORT = {"max_steps": 1, "logging_steps": 1, "eval_strategy": "no", "per_device_train_batch_size": 8}
OPTIMIZERS = ["adamw", "adafactor", "adamw_8bit"]


def assert_matches_the_estimate(spec: JobSpec, data: PreparedData, num_labels: int | None = None) -> None:
    measured = memory_after_one_step(spec, data)
    estimate = estimate_memory(spec, num_labels=num_labels)
    assert measured["parameter_bytes"] == estimate.parameter_bytes
    assert measured["gradient_bytes"] == estimate.gradient_bytes
    assert measured["optimizer_state_bytes"] == estimate.optimizer_state_bytes


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_text_models_match_the_estimate(tmp_path: Path, optimizer: str) -> None:
    files = datagen.write_sentiment_csv(tmp_path / "data", n_train=16, n_val=8)
    spec = parse_spec(
        datagen.tiny_text_spec(
            files,
            model={"config": WIDER},
            optimizer={"name": optimizer},
            training=SHORT,
            efficiency={"mixed_precision": "bf16" if optimizer == "adamw_8bit" else "no"},
        )
    )
    assert_matches_the_estimate(spec, prepare_data(spec, None), num_labels=2)  # positive / negative


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("modality", ["image", "audio"])
def test_image_and_audio_models_match_the_estimate(tmp_path: Path, modality: str, optimizer: str) -> None:
    sections = {"model": {"config": WIDER}, "optimizer": {"name": optimizer}, "training": SHORT}
    if modality == "image":
        data = datagen.write_image_folder(tmp_path / "data")
        spec, labels = parse_spec(datagen.tiny_image_spec(data, **sections)), 3  # red / green / blue
    else:
        data = datagen.write_audio_folder(tmp_path / "data")
        spec, labels = parse_spec(datagen.tiny_audio_spec(data, **sections)), 2  # low / high
    assert_matches_the_estimate(spec, prepare_data(spec, None), num_labels=labels)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("kind", ["full", "lora", "qlora"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_causal_lm_models_match_the_estimate(optimizer: str, kind: str, arch: str) -> None:
    """Parameters (a 4-bit base with its quantisation state), gradients and optimizer state."""
    from tests.trainer_core.llm_runs import counting_data, llm_spec

    # r 16: down_proj's lora_A (16 x 256) is large enough for bnb's 8-bit state, the rest stays 32-bit
    adapter = {} if kind == "full" else {"adapter": {"r": 16}}
    spec = llm_spec(arch, kind, "trainer", optimizer={"name": optimizer}, training=SHORT, **adapter)
    assert_matches_the_estimate(spec, counting_data(8, 0))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_qlora_run_reports_the_estimate(tmp_path: Path, backend: str) -> None:
    """The hardest case through each backend's own memory event (a 4-bit base with its quantisation
    state, 8-bit optimizer state on the adapters); the text path is test_run_optimizers.py's."""
    from tests.trainer_core.llm_runs import counting_data, llm_spec, run_llm

    spec = llm_spec("llama", "qlora", backend, optimizer={"name": "adamw_8bit"}, training=SHORT, adapter={"r": 16})
    result, events = run_llm(spec, tmp_path / "out", counting_data(8, 0))
    assert result.status == "succeeded"
    (memory,) = events.of_kind("memory")
    estimate = estimate_memory(spec)
    assert memory["values"]["parameter_bytes"] == estimate.parameter_bytes
    assert memory["values"]["gradient_bytes"] == estimate.gradient_bytes
    assert memory["values"]["optimizer_state_bytes"] == estimate.optimizer_state_bytes
