"""The optimizer table is the one source: the spec, the planner, the estimator and the builder read it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from tests.trainer_core.memory.conftest import TINY_CONFIGS, SpecFactory
from trainer_core.memory import estimate_memory, plan_memory
from trainer_core.memory.planner import _candidates
from trainer_core.modeling import MODEL_CLASSES, config_from_dict
from trainer_core.optimizers import (
    OPTIMIZER_NAMES,
    OPTIMIZER_TABLE,
    OptimizerMemory,
    OptimizerSpec,
    TensorInfo,
    build_optimizer,
    planner_order,
)
from trainer_core.spec import SpecError, parse_spec

# A valid value other than the default for every optimizer field.
NON_DEFAULT: dict[str, Any] = {
    "adam_beta1": 0.8, "adam_beta2": 0.98, "adam_epsilon": 1e-6, "amsgrad": True,
    "adafactor_beta1": 0.9, "adafactor_decay_rate": -0.5, "adafactor_clip_threshold": 2.0,
    "adafactor_scale_parameter": True, "adafactor_relative_step": True,
}  # fmt: skip


def optimizer_doc(optimizer: dict[str, Any]) -> dict[str, Any]:
    model = {"config": TINY_CONFIGS["text"][1]}
    doc = {"name": "t", "task": "text-classification", "model": model, "dataset": {"path": "csv"}}
    return {**doc, "optimizer": optimizer}


def test_spec_accepts_exactly_the_table_names() -> None:
    schema = OptimizerSpec.model_json_schema()["properties"]["name"]
    assert schema["enum"] == list(OPTIMIZER_NAMES) == list(OPTIMIZER_TABLE)
    for name in OPTIMIZER_NAMES:
        assert parse_spec(optimizer_doc({"name": name})).optimizer.name == name
    with pytest.raises(SpecError) as err:
        parse_spec(optimizer_doc({"name": "sgd"}))
    assert [e.field for e in err.value.errors] == ["optimizer.name"]


def test_every_field_belongs_to_an_optimizer_and_only_applies_there() -> None:
    fields = set(OptimizerSpec.model_fields) - {"name"}
    assert set(NON_DEFAULT) == fields == set().union(*(e.fields for e in OPTIMIZER_TABLE.values()))
    for entry in OPTIMIZER_TABLE.values():
        for field, value in NON_DEFAULT.items():
            doc = optimizer_doc({"name": entry.name, field: value})
            if field in entry.fields:
                assert getattr(parse_spec(doc).optimizer, field) == value
            else:
                with pytest.raises(SpecError) as err:
                    parse_spec(doc)
                assert [e.field for e in err.value.errors] == [f"optimizer.{field}"]


def reranked(monkeypatch: pytest.MonkeyPatch, ranks: dict[str, int]) -> None:
    for name, rank in ranks.items():
        monkeypatch.setitem(OPTIMIZER_TABLE, name, dataclasses.replace(OPTIMIZER_TABLE[name], plan_rank=rank))  # type: ignore[index]


def test_planner_tries_every_entry_in_the_table_order(make_spec: SpecFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = make_spec("distilbert-base-uncased")
    tried = {changes.get("optimizer.name", spec.optimizer.name) for changes in _candidates(spec, True)}
    assert tried == set(OPTIMIZER_TABLE)

    def switches() -> list[str]:
        # Entries that only switch the optimizer differ in nothing but the optimizer's rank.
        plan = plan_memory(spec, 80)
        return [e.spec.optimizer.name for e in plan.entries if list(e.changes) in ([], ["optimizer.name"])]

    assert switches() == planner_order() == sorted(OPTIMIZER_TABLE, key=lambda n: OPTIMIZER_TABLE[n].plan_rank)
    reranked(monkeypatch, {"adamw": 0, "adafactor": 1, "adamw_8bit": 2})
    assert switches() == planner_order() == ["adamw", "adafactor", "adamw_8bit"]


def test_estimator_uses_the_table_state_rule_and_memo_key(
    make_spec: SpecFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[float] = []

    def rule(tensors: Sequence[TensorInfo], spec: OptimizerSpec) -> OptimizerMemory:
        calls.append(spec.adam_epsilon)
        return OptimizerMemory(len(tensors) * 1000, "1000 B per tensor", 7, "seven")

    entry = dataclasses.replace(OPTIMIZER_TABLE["adamw"], state=rule, state_fields=("adam_epsilon",))
    monkeypatch.setitem(OPTIMIZER_TABLE, "adamw", entry)  # type: ignore[index]
    first = estimate_memory(make_spec("text", optimizer={"name": "adamw", "adam_epsilon": 3.25e-7}))
    again = estimate_memory(make_spec("text", optimizer={"name": "adamw", "adam_epsilon": 3.25e-7}))
    other = estimate_memory(make_spec("text", optimizer={"name": "adamw", "adam_epsilon": 4.5e-7}))
    assert first.optimizer_state_bytes == again.optimizer_state_bytes == other.optimizer_state_bytes
    assert first.optimizer_state_bytes % 1000 == 0 and first.optimizer_state_bytes > 0
    assert calls == [3.25e-7, 4.5e-7]  # memoised by the entry's state_fields: one call per value


def test_build_optimizer_uses_the_table_builder(monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[str] = []
    original = OPTIMIZER_TABLE["adafactor"]

    def builder(groups: list[dict[str, Any]], spec: OptimizerSpec, lr: float, model: torch.nn.Module) -> Any:
        built.append(spec.name)
        return original.build(groups, spec, lr, model)

    monkeypatch.setitem(OPTIMIZER_TABLE, "adafactor", dataclasses.replace(original, build=builder))  # type: ignore[index]
    task, config = TINY_CONFIGS["text"]
    model = MODEL_CLASSES[task].from_config(config_from_dict(config))
    optimizer = build_optimizer(model, OptimizerSpec(name="adafactor"), 1e-3, 0.0)
    assert built == ["adafactor"] and type(optimizer).__name__ == "Adafactor"
