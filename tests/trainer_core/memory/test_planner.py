"""Planner entries fit by the estimator's own numbers, keep the effective batch, come fastest first."""

from __future__ import annotations

from tests.trainer_core.memory.conftest import SpecFactory
from trainer_core.memory import estimate_memory, plan_memory
from trainer_core.memory.planner import apply_changes

GIB = 1024**3


def test_entries_fit_and_keep_the_effective_batch(make_spec: SpecFactory) -> None:
    spec = make_spec(
        "bert-large-uncased",
        training={"per_device_train_batch_size": 32},
        efficiency={"gradient_accumulation_steps": 2},
    )
    assert not estimate_memory(spec, gpu_memory_gb=8).fits
    plan = plan_memory(spec, 8)
    assert plan.entries and plan.budget_bytes == 8 * GIB
    for entry in plan.entries:
        estimate = estimate_memory(entry.spec)
        assert estimate.total_bytes == entry.estimate_total_bytes <= plan.budget_bytes
        assert entry.spec == apply_changes(spec, entry.changes)
        batch = entry.spec.training.per_device_train_batch_size
        assert batch * entry.spec.efficiency.gradient_accumulation_steps == 64
        assert entry.reason.endswith("of 8.00 GiB")
    keys = [
        (e.spec.efficiency.gradient_checkpointing, -e.spec.training.per_device_train_batch_size) for e in plan.entries
    ]
    assert keys == sorted(keys)  # no recomputation, then larger micro-batches, first
    assert {e.spec.optimizer.name for e in plan.entries} == {"adamw", "adamw_8bit", "adafactor"}


def test_spec_that_fits_comes_first_unchanged(make_spec: SpecFactory) -> None:
    spec = make_spec("distilbert-base-uncased")
    plan = plan_memory(spec, 80)
    assert plan.entries[0].changes == {}
    assert plan.entries[0].spec == spec


def test_nothing_fits_reports_the_minimum(make_spec: SpecFactory) -> None:
    spec = make_spec("meta-llama/Meta-Llama-3-8B", training={"per_device_train_batch_size": 4})
    plan = plan_memory(spec, 24)
    assert plan.entries == []
    smallest = estimate_memory(apply_changes(spec, plan.minimum_changes)).total_bytes
    assert smallest == plan.minimum_total_bytes > 24 * GIB
    assert plan.minimum_changes["optimizer.name"] in {"adafactor", "adamw_8bit"}
    assert plan.minimum_changes["training.per_device_train_batch_size"] < 4


def test_switching_optimizer_keeps_valid_hyper_parameters(make_spec: SpecFactory) -> None:
    spec = make_spec("text", optimizer={"name": "adamw", "amsgrad": True, "adam_beta2": 0.98})
    eight = apply_changes(spec, {"optimizer.name": "adamw_8bit", "optimizer.amsgrad": False})
    assert eight.optimizer.adam_beta2 == 0.98 and not eight.optimizer.amsgrad
    ada = apply_changes(spec, {"optimizer.name": "adafactor", "optimizer.amsgrad": False})
    assert ada.optimizer.name == "adafactor" and ada.optimizer.adam_beta2 == 0.999
