"""``init_from``: a run starts from another run's checkpoint (trainer_core/init_from.py), on both backends.

Parent checkpoints come from real runs of each backend (their files differ: Trainer's ``optimizer.pt``,
Accelerate's ``optimizer.bin``); the child's model and optimizer are compared with those files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.trainer_core.llm_runs import llm_spec, losses, run_llm
from tests.trainer_core.memory.llm_models import LLM_CONFIGS
from trainer_core.backends.common import build_scheduler, build_training_model, start_optimizer
from trainer_core.optimizers import build_optimizer
from trainer_core.spec import JobSpec, SpecError, parse_spec

BACKENDS = ("trainer", "accelerate")
PARENT_STEPS = 8


@pytest.fixture(scope="module")
def parents(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """The step-8 checkpoint of a full and a LoRA run of the tiny Llama, one per backend."""
    found = {}
    for backend in BACKENDS:
        for kind in ("full", "lora"):
            out = tmp_path_factory.mktemp(f"parent-{backend}-{kind}")
            spec = llm_spec("llama", kind, backend, training={"max_steps": PARENT_STEPS, "save_steps": PARENT_STEPS})
            result, _ = run_llm(spec, out)
            assert result.status == "succeeded"
            found[backend, kind] = out / f"checkpoint-{PARENT_STEPS}"
            assert found[backend, kind].is_dir()
    return found


def child(kind: str, backend: str, folder: Path, **init: Any) -> JobSpec:
    spec = llm_spec("llama", kind, backend, training={"max_steps": 4, "learning_rate": 1e-2})
    return spec.model_copy(update={"init_from": parse_spec(
        {**spec.model_dump(mode="json"), "init_from": {"path": str(folder), **init}}
    ).init_from})  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_full_checkpoint_is_the_new_models_weights(parents: dict[tuple[str, str], Path], backend: str) -> None:
    folder = parents[backend, "full"]
    saved = load_file(str(folder / "model.safetensors"))
    model = build_training_model(child("full", "trainer", folder), [])
    state = model.state_dict()
    fresh = build_training_model(llm_spec("llama", "full", "trainer"), []).state_dict()
    for name, value in saved.items():
        assert torch.equal(state[name], value), name
    assert any(not torch.equal(fresh[name], value) for name, value in saved.items())  # training moved them


def test_a_classifier_starts_from_a_causal_lm_checkpoint(parents: dict[tuple[str, str], Path]) -> None:
    """Another task head, as transformers allows: the backbone loads, the classifier starts fresh."""
    folder = parents["trainer", "full"]
    saved = load_file(str(folder / "model.safetensors"))
    doc = {
        "name": "classifier", "task": "text-classification", "model": {"config": dict(LLM_CONFIGS["llama"])},
        "dataset": {"path": "csv"}, "init_from": {"path": str(folder)},
    }  # fmt: skip
    model = build_training_model(parse_spec(doc), ["negative", "positive"])
    state = model.state_dict()
    backbone = [name for name in saved if name.startswith("model.")]
    assert backbone and all(torch.equal(state[name], saved[name]) for name in backbone)
    assert state["score.weight"].shape == (2, LLM_CONFIGS["llama"]["hidden_size"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_adapter_continues_on_the_same_base(parents: dict[tuple[str, str], Path], backend: str) -> None:
    from peft import get_peft_model_state_dict

    folder = parents[backend, "lora"]
    saved = load_file(str(folder / "adapter_model.safetensors"))
    model = build_training_model(child("lora", "accelerate", folder), [])
    own = get_peft_model_state_dict(model)  # type: ignore[arg-type]
    lora = [name for name in own if "lora_" in name]
    assert lora and all(torch.equal(own[name], saved[name]) for name in lora)
    assert any(torch.count_nonzero(saved[name]) for name in lora if "lora_B" in name)  # not PEFT's zero init


def test_an_adapter_of_another_rank_or_none_is_refused(parents: dict[tuple[str, str], Path]) -> None:
    folder = parents["trainer", "lora"]
    other = child("lora", "trainer", folder)
    assert other.adapter is not None
    wider = other.model_copy(update={"adapter": other.adapter.model_copy(update={"r": 4})})
    with pytest.raises(SpecError) as raised:
        build_training_model(wider, [])
    assert [e.field for e in raised.value.errors] == ["init_from.path"] and "rank 8" in str(raised.value)
    with pytest.raises(SpecError) as raised:
        build_training_model(child("full", "trainer", folder), [])
    assert "holds a LoRA adapter" in str(raised.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_optimizer_takes_the_moments_and_keeps_this_runs_learning_rate(
    parents: dict[tuple[str, str], Path], backend: str
) -> None:
    folder = parents[backend, "full"]
    spec = child("full", "trainer", folder, resume_optimizer=True)
    spec = spec.model_copy(update={"training": spec.training.model_copy(update={"learning_rate": 3e-4})})
    model = build_training_model(spec, [])
    optimizer = build_optimizer(model, spec.optimizer, 3e-4, 0.0)
    start_optimizer(spec, optimizer, fresh=True)
    saved = torch.load(folder / ("optimizer.pt" if backend == "trainer" else "optimizer.bin"), weights_only=True)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for index, state in saved["state"].items():
        assert torch.equal(optimizer.state[params[int(index)]]["exp_avg"], state["exp_avg"])
    assert all(group["lr"] == 3e-4 for group in optimizer.param_groups)
    scheduler = build_scheduler(spec, optimizer, total_steps=10)  # linear decay from this run's own rate
    scheduler.step()
    assert all(group["lr"] == pytest.approx(3e-4 * 9 / 10) for group in optimizer.param_groups)
    resumed = build_optimizer(model, spec.optimizer, 3e-4, 0.0)
    start_optimizer(spec, resumed, fresh=False)  # resuming its own checkpoint: the backend loads that one
    assert not resumed.state


def test_resume_optimizer_refuses_another_set_of_parameters(parents: dict[tuple[str, str], Path]) -> None:
    """A LoRA run's optimizer holds the adapters only: it cannot drive a full fine-tune."""
    folder = parents["trainer", "lora"]
    spec = child("lora", "trainer", folder, resume_optimizer=True)
    full = build_training_model(llm_spec("llama", "full", "trainer"), [])
    optimizer = build_optimizer(full, spec.optimizer, 1e-3, 0.0)
    with pytest.raises(SpecError) as raised:
        start_optimizer(spec, optimizer, fresh=True)
    assert [e.field for e in raised.value.errors] == ["init_from.resume_optimizer"]
    assert "parameter groups, this run has 2" in str(raised.value)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_run_from_a_checkpoint_starts_where_its_parent_ended(
    parents: dict[tuple[str, str], Path], backend: str, tmp_path: Path
) -> None:
    """Through each backend: the child starts from the trained weights, well below a random start."""
    _, fresh_events = run_llm(llm_spec("llama", "full", backend, training={"max_steps": 2}), tmp_path / "fresh")
    continued, events = run_llm(child("full", backend, parents["accelerate", "full"]), tmp_path / "child")
    assert continued.status == "succeeded"
    assert losses(events)[0] < 0.9 * losses(fresh_events)[0]  # a random start is at ln(vocab) = 5.7


def test_a_missing_folder_or_a_job_without_the_service_is_a_field_error(tmp_path: Path) -> None:
    from trainer_core.init_from import init_source

    with pytest.raises(SpecError) as raised:
        init_source(child("full", "trainer", tmp_path / "nowhere"))
    assert [e.field for e in raised.value.errors] == ["init_from.path"]
    doc = {**llm_spec("llama", "full", "trainer").model_dump(mode="json"), "init_from": {"job": "abc123"}}
    with pytest.raises(SpecError) as raised:
        init_source(parse_spec(doc))
    assert [e.field for e in raised.value.errors] == ["init_from.job"]
