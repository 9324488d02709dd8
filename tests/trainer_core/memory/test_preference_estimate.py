"""DPO and ORPO estimates: twice the rows of a micro-batch, DPO's reference weights and forward as their own
lines, the planner's preference proposals; SFT estimates exactly as before."""

from __future__ import annotations

from typing import Any

import pytest

from tests.trainer_core.memory.llm_models import LLM_CONFIGS
from trainer_core.memory import estimate_memory, plan_memory
from trainer_core.memory.planner import apply_changes
from trainer_core.spec import JobSpec, parse_spec

GIB = 1024**3
LLAMA_1B = "meta-llama/Llama-3.2-1B"
LORA: dict[str, Any] = {"type": "lora", "r": 16, "alpha": 32, "dropout": 0.05}
QLORA: dict[str, Any] = {"type": "qlora", "r": 16, "alpha": 32, "compute_dtype": "bf16"}


def llm(method: str = "sft", batch: int = 2, **sections: Any) -> dict[str, Any]:
    """A spec document for Llama-3.2-1B (catalog) at 512 tokens, bf16."""
    doc: dict[str, Any] = {
        "name": "pref", "task": "causal-lm", "method": method, "model": {"name_or_path": LLAMA_1B},
        "dataset": {"path": "json"}, "preprocessing": {"max_length": 512},
        "training": {"per_device_train_batch_size": batch}, "efficiency": {"mixed_precision": "bf16"},
    }  # fmt: skip
    doc.update(sections)
    return doc


def parts(spec: JobSpec) -> dict[str, int]:
    return {p.name: p.bytes for p in estimate_memory(spec).parts}


@pytest.mark.parametrize("adapter", [None, LORA, QLORA])
@pytest.mark.parametrize("method", ["dpo", "orpo"])
def test_a_pair_costs_the_activations_and_logits_of_two_rows(method: str, adapter: dict[str, Any] | None) -> None:
    """B pairs are one forward of 2B rows (LoRA's dropout off: a preference run sets every Dropout to 0)."""
    pair_spec = parse_spec(llm(method, batch=2, adapter=adapter))
    row_spec = parse_spec(llm("sft", batch=4, adapter={**adapter, "dropout": 0.0} if adapter else None))
    pairs, rows = estimate_memory(pair_spec), estimate_memory(row_spec)
    assert pairs.activation_bytes == rows.activation_bytes
    assert parts(pair_spec)["logits_fp32"] == parts(row_spec)["logits_fp32"] == 4 * 512 * 128_256 * 4
    assert (pairs.parameter_bytes, pairs.gradient_bytes) == (rows.parameter_bytes, rows.gradient_bytes)
    assert pairs.optimizer_state_bytes == rows.optimizer_state_bytes
    assert "b=2x2 (chosen + rejected)" in next(p.formula for p in pairs.parts if p.name == "activations")


def test_a_preference_run_counts_no_dropout_masks() -> None:
    """GPT-2 has dropout 0.1: its SFT estimate counts the masks, a pair's does not."""
    config = dict(LLM_CONFIGS["gpt2"])
    doc = llm("orpo", batch=2, model={"config": config}, preprocessing={"max_length": 32})
    orpo = estimate_memory(parse_spec(doc))
    sft = estimate_memory(parse_spec({**doc, "method": "sft", "training": {"per_device_train_batch_size": 4}}))
    quiet = {**config, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0}
    sft_quiet = estimate_memory(parse_spec({**doc, "method": "sft", "model": {"config": quiet},
                                            "training": {"per_device_train_batch_size": 4}}))  # fmt: skip
    assert orpo.activation_bytes < sft.activation_bytes
    assert orpo.activation_bytes == sft_quiet.activation_bytes


def test_full_dpo_with_base_keeps_a_copy_of_the_weights() -> None:
    dpo = estimate_memory(parse_spec(llm("dpo")))
    orpo = estimate_memory(parse_spec(llm("orpo")))
    assert dpo.reference_weight_bytes == dpo.parameter_bytes == 4 * dpo.parameters  # fp32 master, once more
    assert dpo.total_bytes == orpo.total_bytes + dpo.reference_weight_bytes  # the reference phase is the smaller
    lines = {p.name: p for p in dpo.parts}
    assert lines["reference_weights"].bytes == dpo.reference_weight_bytes
    assert lines["reference_weights"].note == "dpo, reference: base"


@pytest.mark.parametrize(
    "doc",
    [
        llm("dpo", adapter=LORA),
        llm("dpo", adapter=QLORA),
        llm("dpo", preference={"reference": "precomputed"}),
        llm("orpo"),
        llm("orpo", adapter=LORA),
    ],
    ids=["lora", "qlora", "precomputed", "orpo", "orpo-lora"],
)
def test_no_reference_weights_without_a_frozen_copy(doc: dict[str, Any]) -> None:
    estimate = estimate_memory(parse_spec(doc))
    assert estimate.reference_weight_bytes == 0
    assert parts(parse_spec(doc))["reference_weights"] == 0


def test_an_adapter_continued_from_init_from_is_its_own_reference() -> None:
    """The starting adapter is loaded a second time, frozen, as the reference: its fp32 LoRA tensors."""
    spec = parse_spec(llm("dpo", adapter=LORA, init_from={"path": "/checkpoints/sft/checkpoint-40"}))
    estimate = estimate_memory(spec)
    assert estimate.reference_weight_bytes == estimate.gradient_bytes == 4 * estimate.trainable_parameters
    precomputed = spec.model_copy(update={"preference": spec.preference_settings.model_copy(
        update={"reference": "precomputed"})})  # fmt: skip
    assert estimate_memory(precomputed).reference_weight_bytes == 0


@pytest.mark.parametrize("adapter", [None, LORA])
def test_the_reference_forward_is_a_phase_of_its_own(adapter: dict[str, Any] | None) -> None:
    """DPO scoring its reference each step: a no-grad forward of 2B rows before the policy's; counted
    as one more phase of the total, below the training forward here (as it is for any real model)."""
    spec = parse_spec(llm("dpo", adapter=adapter))
    estimate, lines = estimate_memory(spec), parts(spec)
    training_phase = lines["activations"] + lines["autocast_copies"] + lines["logits_fp32"]
    assert 0 < estimate.reference_forward_bytes < training_phase
    fixed = sum(lines[k] for k in ("parameters", "reference_weights", "gradients", "optimizer_state", "overhead"))
    phase = max(training_phase, lines["reference_forward"], lines["optimizer_step_temporary"])
    assert estimate.total_bytes == fixed + lines["ddp_buckets"] + phase
    # The fp32 residual (2B x s x h x 4 B), then at a 128k vocabulary the head: the logits (2B x s x vocab
    # at 2 B) and one row's fp32 log-softmax at a time (no grad: each is freed before the next).
    assert estimate.reference_forward_bytes == 4 * 512 * 2048 * 4 + 4 * 512 * 128_256 * 2 + 512 * 128_256 * 4
    precomputed = llm("dpo", adapter=adapter, preference={"reference": "precomputed"})
    for no_forward in (llm("orpo", adapter=adapter), precomputed):
        assert estimate_memory(parse_spec(no_forward)).reference_forward_bytes == 0


def test_sft_estimates_are_unchanged() -> None:
    """Totals the estimator gave before DPO/ORPO existed (commit bd3e655), and no reference lines."""
    fp32 = llm("sft", batch=4, efficiency={"mixed_precision": "no"})
    lora = llm("sft", batch=4, adapter={"type": "lora", "dropout": 0.05})
    assert estimate_memory(parse_spec(fp32)).total_bytes == 29_545_759_304
    assert estimate_memory(parse_spec(fp32)).activation_bytes == 7_648_313_344
    assert estimate_memory(parse_spec(lora)).total_bytes == 10_645_803_904
    sft = estimate_memory(parse_spec(lora))
    assert (sft.reference_weight_bytes, sft.reference_forward_bytes) == (0, 0)
    assert not {"reference_weights", "reference_forward"} & {p.name for p in sft.parts}


def test_planner_offers_precomputed_and_adapters_for_a_full_dpo_job() -> None:
    spec = parse_spec(llm("dpo", batch=2, preprocessing={"max_length": 1024}))
    estimate = estimate_memory(spec)
    budget = (estimate.total_bytes - estimate.reference_weight_bytes // 2) / GIB  # fits without the copy only
    plan = plan_memory(spec, budget)
    precomputed = [e for e in plan.entries if e.changes.get("preference.reference") == "precomputed"]
    adapters = [e for e in plan.entries if "adapter" in e.changes]
    assert {"preference.reference": "precomputed"} in [e.changes for e in precomputed]
    assert all(e.spec.adapter is None for e in precomputed)
    assert {e.spec.adapter.type for e in adapters if e.spec.adapter} == {"lora", "qlora"}
    assert all(e.spec.preference_settings.reference == "base" for e in adapters)  # the base, adapter disabled
    assert plan.entries.index(precomputed[0]) < plan.entries.index(adapters[0])
    for entry in plan.entries:
        assert estimate_memory(entry.spec).total_bytes == entry.estimate_total_bytes <= plan.budget_bytes
        assert entry.spec == apply_changes(spec, entry.changes)
    assert "reference log-probs precomputed before training" in precomputed[0].reason


def test_planner_offers_no_precomputed_reference_where_there_is_none() -> None:
    orpo = parse_spec(llm("orpo", batch=2, preprocessing={"max_length": 1024}))
    plan = plan_memory(orpo, estimate_memory(orpo).total_bytes / GIB - 1)
    assert plan.entries and not any("preference.reference" in e.changes for e in plan.entries)
    assert any("adapter" in e.changes for e in plan.entries)  # ORPO that does not fit: adapters too
    fits = plan_memory(orpo, 80)
    assert fits.entries[0].changes == {} and all("adapter" not in e.changes for e in fits.entries)


def test_apply_changes_fills_a_preference_section_left_out_or_null() -> None:
    for doc in (llm("dpo"), llm("dpo", preference=None)):
        spec = apply_changes(parse_spec(doc), {"preference.reference": "precomputed"})
        assert spec.preference_settings.reference == "precomputed"
