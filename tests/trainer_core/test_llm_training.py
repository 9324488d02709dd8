"""Causal-LM training on both backends: full, LoRA and QLoRA learn; adapters leave the base untouched;
resume continues to the same adapter; the saved adapter reloads with PEFT and generates."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tests.trainer_core.llm_runs import VOCAB, counting_data, llm_spec, losses, run_llm
from tests.trainer_core.runhelpers import BACKENDS
from trainer_core.backends import accelerate_backend, common, trainer_backend
from trainer_core.spec import JobSpec

ADAPTER_FILE = "adapter_model.safetensors"


def record_model(monkeypatch: pytest.MonkeyPatch) -> list[nn.Module]:
    """The models the backends build, kept for inspection (the real builder still builds them)."""
    built: list[nn.Module] = []

    def recording(spec: JobSpec, labels: list[str], *, fresh: bool = True) -> nn.Module:
        model = common.build_training_model(spec, labels, fresh=fresh)
        built.append(model)
        return model

    for module in (trainer_backend, accelerate_backend):
        monkeypatch.setattr(module, "build_training_model", recording)
    return built


def named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["full", "lora", "qlora"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_loss_falls_and_adapters_leave_the_base_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str, kind: str
) -> None:
    spec = llm_spec("llama", kind, backend)
    initial = named_tensors(common.build_training_model(spec, []))  # seeded: the run builds this same model
    built = record_model(monkeypatch)
    result, events = run_llm(spec, tmp_path / "out")
    assert result.status == "succeeded" and result.global_step == 8
    logged = losses(events)
    assert logged[-1] < logged[0] - 0.2, logged
    (model,) = built
    trained = named_tensors(model)
    assert trained.keys() == initial.keys()
    changed = {name for name in trained if not torch.equal(trained[name], initial[name])}
    if kind == "full":
        assert changed == set(trained)
        return
    adapters = {name for name in trained if ".lora_" in name}
    assert adapters
    assert {n for n in adapters if ".lora_B." in n} <= changed  # B starts at zero and must have moved
    assert not changed - adapters, "a frozen base weight changed"
    saved = load_file(str(tmp_path / "out" / ADAPTER_FILE))
    assert saved and all("lora_" in name for name in saved)


@pytest.mark.parametrize("backend", BACKENDS)
def test_evaluation_reports_loss_and_perplexity(tmp_path: Path, backend: str) -> None:
    spec = llm_spec("gpt2", "lora", backend, training={"max_steps": 2, "eval_strategy": "steps", "eval_steps": 2})
    result, events = run_llm(spec, tmp_path / "out", counting_data(16, 8))
    (evaluation,) = [e["values"] for e in events.of_kind("eval")]
    assert set(evaluation) == {"eval_loss", "eval_perplexity"}
    assert evaluation["eval_perplexity"] == pytest.approx(math.exp(evaluation["eval_loss"]))
    assert result.eval_metrics == evaluation


@pytest.mark.parametrize("backend", BACKENDS)
def test_efficiency_settings_train_an_adapter(tmp_path: Path, backend: str) -> None:
    """Checkpointing (the input-grad hook), accumulation, bf16 autocast, 8-bit optimizer state on the
    adapters only, and local SGD on accelerate."""
    efficiency: dict[str, Any] = {
        "gradient_checkpointing": True, "gradient_accumulation_steps": 2, "mixed_precision": "bf16",
    }  # fmt: skip
    if backend == "accelerate":
        efficiency["local_sgd_steps"] = 2
    spec = llm_spec("qwen2", "lora", backend, efficiency=efficiency, optimizer={"name": "adamw_8bit"})
    result, events = run_llm(spec, tmp_path / "out")
    assert result.status == "succeeded"
    logged = losses(events)
    assert logged[-1] < logged[0] - 0.2, logged
    (memory,) = [e["values"] for e in events.of_kind("memory")]
    assert memory["gradient_bytes"] < memory["parameter_bytes"] // 4  # adapters only


@pytest.mark.parametrize("kind", ["lora", "qlora"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_gives_the_adapter_of_an_uninterrupted_run(tmp_path: Path, backend: str, kind: str) -> None:
    spec = llm_spec("llama", kind, backend, training={"max_steps": 6, "save_steps": 3})
    whole, _ = run_llm(spec, tmp_path / "whole")
    assert whole.status == "succeeded"
    resumed, events = run_llm(spec, tmp_path / "resumed", resume_from=tmp_path / "whole" / "checkpoint-3")
    assert resumed.status == "succeeded" and resumed.global_step == 6
    assert [e["step"] for e in events.of_kind("progress")] == [4, 5, 6]
    expected = load_file(str(tmp_path / "whole" / ADAPTER_FILE))
    got = load_file(str(tmp_path / "resumed" / ADAPTER_FILE))
    assert expected.keys() == got.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("kind", ["lora", "qlora"])
def test_the_saved_adapter_reloads_with_peft_and_generates(tmp_path: Path, kind: str) -> None:
    from peft import PeftModel

    from trainer_core.adapters import build_base_model

    spec = llm_spec("gpt2", kind, "accelerate")
    result, _ = run_llm(spec, tmp_path / "out")
    assert result.status == "succeeded"
    torch.manual_seed(spec.training.seed)
    base = build_base_model(spec, [])  # the same seeded random base the run started from
    prompt = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        before = base(input_ids=prompt).logits
    model = PeftModel.from_pretrained(base, str(tmp_path / "out")).eval()
    saved = load_file(str(tmp_path / "out" / ADAPTER_FILE))
    loaded = {n.replace(".default", ""): p for n, p in model.named_parameters() if "lora_" in n}
    assert {n.removeprefix("base_model.model.") for n in saved} == {n.removeprefix("base_model.model.") for n in loaded}
    with torch.no_grad():
        after = model(input_ids=prompt).logits
        generated = model.generate(input_ids=prompt, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert not torch.allclose(before, after), "the adapter changed nothing"
    assert generated.shape == (1, 7) and int(generated.max()) < VOCAB


def test_merge_writes_a_plain_model_equal_to_base_plus_adapter(tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainer_core.adapters import build_base_model
    from trainer_core.backends.common import MERGED_DIR

    spec = llm_spec("llama", "lora", "trainer", training={"max_steps": 3})
    spec = spec.model_copy(update={"adapter": spec.adapter.model_copy(update={"merge": True})})  # type: ignore[union-attr]
    result, _ = run_llm(spec, tmp_path / "out")
    assert result.status == "succeeded"
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / MERGED_DIR).eval()
    torch.manual_seed(spec.training.seed)
    adapted = PeftModel.from_pretrained(build_base_model(spec, []), str(tmp_path / "out")).eval()
    prompt = torch.tensor([[3, 4, 5, 6, 7]])
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=prompt).logits, adapted(input_ids=prompt).logits, atol=1e-4, rtol=0)
