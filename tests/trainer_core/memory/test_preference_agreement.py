"""DPO and ORPO runs through both real backends report, to the byte, the estimate's parameter, gradient and
optimizer-state bytes after their first optimizer step (the memory event), and hold the reference weights
the estimate counts: a frozen copy for a full fine-tune scoring ``reference: base``, nothing beside the
trained model for LoRA/QLoRA (the adapter disabled), ``precomputed`` or ORPO.

As test_run_agreement.py does for SFT, on the tiny Llama of tests/trainer_core/memory/llm_models.py and
the hand-made pairs of tests/trainer_core/test_preference_training.py. The reference weights are not in
the memory event (they are no parameter of the trained model): the reference a run builds is recorded
where the backends ask for it (``trainer_core.backends.reference.reference_scorer``) and measured there.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from tests.trainer_core.llm_runs import run_llm
from tests.trainer_core.runhelpers import BACKENDS
from tests.trainer_core.test_preference_training import preference_data, preference_spec
from trainer_core.backends import objective, reference
from trainer_core.memory import estimate_memory
from trainer_core.memory_report import parameter_tensors
from trainer_core.spec import JobSpec

ONE_STEP = {"max_steps": 1, "logging_steps": 1}


def record_references(monkeypatch: pytest.MonkeyPatch) -> list[tuple[nn.Module, nn.Module]]:
    """(reference module, trained model) of each reference a run keeps for training."""
    kept: list[tuple[nn.Module, nn.Module]] = []
    build: Callable[..., reference.ReferenceScorer] = reference.reference_scorer

    def recording(spec: JobSpec, model: nn.Module, *args: Any, frozen_copy: bool) -> reference.ReferenceScorer:
        scorer = build(spec, model, *args, frozen_copy=frozen_copy)
        if frozen_copy:  # the precomputed pass scores with the model itself and keeps nothing
            kept.append((scorer.module, model))
        return scorer

    monkeypatch.setattr(objective, "reference_scorer", recording)  # where the backends call it
    return kept


def extra_weight_bytes(kept: list[tuple[nn.Module, nn.Module]]) -> int:
    """Bytes of the reference's weights (4-bit quantisation state included) that the trained model does
    not hold itself: each storage once."""
    extra: dict[int, int] = {}
    for module, model in kept:
        own = {t.untyped_storage().data_ptr() for t in parameter_tensors(model)}
        for t in parameter_tensors(module):
            storage = t.untyped_storage()
            if storage.data_ptr() not in own:
                extra[storage.data_ptr()] = storage.nbytes()
    return sum(extra.values())


def run_one_step(spec: JobSpec, out: Path) -> dict[str, Any]:
    result, events = run_llm(spec, out, data=preference_data(8, 0))
    assert result.status == "succeeded", result
    (memory,) = events.of_kind("memory")
    values: dict[str, Any] = memory["values"]
    return values


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("method", ["dpo", "orpo"])
@pytest.mark.parametrize("kind", ["lora", "qlora", "full"])
def test_a_preference_run_holds_what_the_estimate_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str, method: str, backend: str
) -> None:
    kept = record_references(monkeypatch)
    spec = preference_spec(method, kind, backend, training=ONE_STEP)
    measured = run_one_step(spec, tmp_path / "out")
    estimate = estimate_memory(spec)
    assert measured["parameter_bytes"] == estimate.parameter_bytes
    assert measured["gradient_bytes"] == estimate.gradient_bytes
    assert measured["optimizer_state_bytes"] == estimate.optimizer_state_bytes
    assert extra_weight_bytes(kept) == estimate.reference_weight_bytes
    assert (estimate.reference_weight_bytes > 0) == (method == "dpo" and kind == "full")


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bf16_run_keeps_its_frozen_copy_at_the_master_dtype(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    kept = record_references(monkeypatch)
    spec = preference_spec("dpo", "full", backend, training=ONE_STEP, efficiency={"mixed_precision": "bf16"})
    measured = run_one_step(spec, tmp_path / "out")
    estimate = estimate_memory(spec)
    assert measured["parameter_bytes"] == estimate.parameter_bytes == extra_weight_bytes(kept)
    assert estimate.reference_weight_bytes == estimate.parameter_bytes


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_precomputed_reference_keeps_no_weights(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    kept = record_references(monkeypatch)
    spec = preference_spec("dpo", "full", backend, "precomputed", training=ONE_STEP)
    measured = run_one_step(spec, tmp_path / "out")
    estimate = estimate_memory(spec)
    assert (measured["parameter_bytes"], measured["optimizer_state_bytes"]) == (
        estimate.parameter_bytes, estimate.optimizer_state_bytes)  # fmt: skip
    assert kept == [] and estimate.reference_weight_bytes == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_adapter_from_init_from_is_a_second_frozen_adapter(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """The SFT adapter the run starts from is loaded again, frozen, as the reference: an adapter of the
    trained PEFT model, so the memory event's parameters count it; the estimate lists it apart."""
    from tests.trainer_core.llm_runs import llm_spec

    sft, _ = run_llm(llm_spec("llama", "lora", backend, training=ONE_STEP), tmp_path / "sft")
    assert sft.status == "succeeded"
    spec = preference_spec("dpo", "lora", backend, init_from={"path": str(tmp_path / "sft")}, training=ONE_STEP)
    measured = run_one_step(spec, tmp_path / "dpo")
    estimate = estimate_memory(spec)
    assert estimate.reference_weight_bytes == estimate.gradient_bytes > 0  # the LoRA tensors once more, fp32
    assert measured["parameter_bytes"] == estimate.parameter_bytes + estimate.reference_weight_bytes
    assert (measured["gradient_bytes"], measured["optimizer_state_bytes"]) == (
        estimate.gradient_bytes, estimate.optimizer_state_bytes)  # fmt: skip
