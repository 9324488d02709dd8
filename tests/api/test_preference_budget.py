"""A full DPO job that fits only without its frozen reference copy is refused naming `preference.reference`,
with the planner's precomputed and adapter alternatives in the message (api/estimation.py, at submit)."""

from __future__ import annotations

from typing import Any

import pytest

from api.estimation import estimate_for_submit
from api.problems import Problem
from service_core.settings import Settings
from trainer_core.memory import estimate_memory
from trainer_core.memory.planner import PRECOMPUTED_REFERENCE, apply_changes
from trainer_core.spec import JobSpec, parse_spec

GIB = 1024**3


def dpo_spec(budget_gb: float | None = None, **sections: Any) -> JobSpec:
    """Full-fine-tune DPO of Llama-3.2-1B (catalog) at 1,024 tokens, bf16, with ``reference: base``."""
    return parse_spec({
        "name": "dpo", "task": "causal-lm", "method": "dpo", "model": {"name_or_path": "meta-llama/Llama-3.2-1B"},
        "dataset": {"path": "json", "data_files": {"train": "prefs/train.jsonl"}},
        "preprocessing": {"max_length": 1024}, "training": {"per_device_train_batch_size": 2},
        "efficiency": {"mixed_precision": "bf16"}, "resources": {"gpu_memory_gb": budget_gb}, **sections,
    })  # fmt: skip


def refusal(spec: JobSpec, settings: Settings) -> Problem:
    with pytest.raises(Problem) as info:
        estimate_for_submit(spec, settings.default_queue, settings)
    assert info.value.status == 422
    return info.value


def test_a_budget_that_holds_the_job_but_not_its_reference_copy_names_the_reference(settings: Settings) -> None:
    base = estimate_memory(dpo_spec())
    precomputed = estimate_memory(apply_changes(dpo_spec(), PRECOMPUTED_REFERENCE))
    assert base.total_bytes - precomputed.total_bytes >= base.reference_weight_bytes > 0
    budget = (base.total_bytes + precomputed.total_bytes) / 2 / GIB
    problem = refusal(dpo_spec(budget), settings)
    (error,) = problem.extra["errors"]
    assert error["field"] == "preference.reference"
    assert "frozen copy of the starting weights" in error["message"]
    assert problem.detail is not None
    assert f"preference.reference=precomputed (the reference log-probs scored once before training) it needs " \
           f"{precomputed.total_bytes / GIB:.2f} GiB" in problem.detail  # fmt: skip
    assert "or train an adapter: adapter={'type': 'lora'" in problem.detail
    entries = problem.extra["plan"]["entries"]
    assert {"preference.reference": "precomputed"} in [e["changes"] for e in entries]
    assert problem.extra["estimate"]["reference_weight_bytes"] == base.reference_weight_bytes


def test_a_budget_too_small_even_without_the_copy_names_the_budget(settings: Settings) -> None:
    precomputed = estimate_memory(apply_changes(dpo_spec(), PRECOMPUTED_REFERENCE))
    problem = refusal(dpo_spec(precomputed.total_bytes / GIB - 0.5), settings)
    assert problem.extra["errors"][0]["field"] == "resources.gpu_memory_gb"


def test_an_adapter_job_has_no_copy_to_blame(settings: Settings) -> None:
    spec = dpo_spec(2.0, adapter={"type": "lora"})
    problem = refusal(spec, settings)
    assert problem.extra["errors"][0]["field"] == "resources.gpu_memory_gb"
