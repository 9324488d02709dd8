"""The chunked causal-LM loss equals the plain one: the loss and every gradient (rel 1e-5), on Llama,
Qwen2 (tied head) and GPT-2, full and with LoRA, mean-reduced and over a given token count, with
chunks smaller than the batch; runs with ``efficiency.chunked_loss`` on both backends log the plain
run's losses and end on its weights; a model whose logits change after the head is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from tests.trainer_core.llm_runs import llm_spec, losses, run_llm
from tests.trainer_core.memory.llm_models import LLM_CONFIGS, build_llm
from trainer_core.chunked_loss import causal_lm_loss, chunkable, chunked_cross_entropy
from trainer_core.spec import SpecError, parse_spec


def llm(model_type: str, adapter: dict[str, Any] | None) -> nn.Module:
    spec = parse_spec({"name": "x", "task": "causal-lm", "model": {"config": LLM_CONFIGS[model_type]},
                       "dataset": {"path": "json"}, "adapter": adapter})  # fmt: skip
    return build_llm(spec).train()


def batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 300, (3, 11), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 8:] = 0  # right padding, as the collator gives
    labels = ids.clone()
    labels[:, :4] = -100  # a prompt
    labels[mask == 0] = -100
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gpt2"])
@pytest.mark.parametrize("adapter", [None, {"type": "lora", "r": 4, "dropout": 0.0}])
@pytest.mark.parametrize("num_items", [None, 13])
def test_loss_and_gradients_equal_the_plain_loss(model_type: str, adapter: Any, num_items: int | None) -> None:
    model = llm(model_type, adapter)
    assert chunkable(model)
    data = batch()
    extra = {} if num_items is None else {"num_items_in_batch": torch.tensor(num_items)}
    torch.manual_seed(2)  # the same dropout masks (GPT-2's) in both forwards
    plain = model(**data, **extra).loss
    plain.backward()
    expected = grads(model)
    torch.manual_seed(2)
    chunked = causal_lm_loss(model, data, num_items)
    chunked.backward()
    got = grads(model)
    torch.testing.assert_close(chunked, plain, rtol=1e-5, atol=0)
    assert got.keys() == expected.keys() and expected
    for name in expected:
        # atol: float32 sums in another order (by chunk) differ by a few ulps at the gradients' scale (~1,
        # where an ulp is 6e-8), in elements that vary with the CPU's vector width (AVX2, AVX-512).
        torch.testing.assert_close(got[name], expected[name], rtol=1e-5, atol=5e-7, msg=name)


def test_small_chunks_and_a_biased_head_give_the_plain_loss() -> None:
    torch.manual_seed(0)
    head = nn.Linear(16, 50)
    hidden = torch.randn(2, 9, 16, requires_grad=True)
    labels = torch.randint(0, 50, (2, 9))
    labels[0, :3] = -100
    plain = nn.functional.cross_entropy(head(hidden)[:, :-1].reshape(-1, 50), labels[:, 1:].reshape(-1))
    plain.backward()
    expected = (hidden.grad.clone(), head.weight.grad.clone(), head.bias.grad.clone())  # type: ignore[union-attr]
    hidden.grad, head.weight.grad, head.bias.grad = None, None, None
    chunked = chunked_cross_entropy(hidden, head, labels, chunk=4)  # 18 targets: 5 chunks, one all-ignored
    chunked.backward()
    torch.testing.assert_close(chunked, plain, rtol=1e-5, atol=0)
    for got, want in zip((hidden.grad, head.weight.grad, head.bias.grad), expected, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)


def test_no_gradient_is_computed_without_grad() -> None:
    model = llm("llama", None).eval()
    with torch.no_grad():
        loss = causal_lm_loss(model, batch())
        plain = model(**batch()).loss
    assert not loss.requires_grad
    torch.testing.assert_close(loss, plain, rtol=1e-5, atol=0)


def test_a_model_with_a_logit_soft_cap_is_not_chunkable() -> None:
    model = llm("llama", None)
    model.config.final_logit_softcapping = 30.0
    assert not chunkable(model)


@pytest.mark.parametrize("backend", ["trainer", "accelerate"])
@pytest.mark.parametrize("kind", ["full", "lora"])
def test_a_chunked_run_trains_and_evaluates_as_the_plain_run(tmp_path: Path, backend: str, kind: str) -> None:
    """Both backends, with accumulation: the same logged losses, evaluation and final weights."""
    training = {"max_steps": 3, "eval_strategy": "steps", "eval_steps": 3, "per_device_train_batch_size": 4}
    plain_spec = llm_spec("llama", kind, backend, training=training, efficiency={"gradient_accumulation_steps": 2})
    chunked_spec = llm_spec("llama", kind, backend, training=training,
                            efficiency={"gradient_accumulation_steps": 2, "chunked_loss": True})  # fmt: skip
    plain, plain_events = run_llm(plain_spec, tmp_path / "plain")
    chunked, chunked_events = run_llm(chunked_spec, tmp_path / "chunked")
    assert len(losses(plain_events)) == 3
    torch.testing.assert_close(losses(chunked_events), losses(plain_events), rtol=1e-5, atol=0)
    torch.testing.assert_close(chunked.eval_metrics["eval_loss"], plain.eval_metrics["eval_loss"], rtol=1e-5, atol=0)
    name = "adapter_model.safetensors" if kind == "lora" else "model.safetensors"
    got, want = load_file(str(tmp_path / "chunked" / name)), load_file(str(tmp_path / "plain" / name))
    assert got.keys() == want.keys()
    for key in want:  # Adam magnifies rounding where a gradient is near 0: weights of ~0.1 agree to 2e-5
        torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=2e-5, msg=key)


def test_a_model_that_changes_its_logits_is_refused_naming_the_setting(tmp_path: Path) -> None:
    capped = {**LLM_CONFIGS["llama"], "final_logit_softcapping": 30.0}
    spec = llm_spec("llama", "full", "trainer", efficiency={"chunked_loss": True})
    spec = spec.model_copy(update={"model": spec.model.model_copy(update={"config": capped})})
    with pytest.raises(SpecError) as refused:
        run_llm(spec, tmp_path)
    assert [e.field for e in refused.value.errors] == ["efficiency.chunked_loss"]
    from trainer_core.lm_preflight import lm_errors

    assert [e.field for e in lm_errors(spec, [], [])] == ["efficiency.chunked_loss"]  # at submit too
