"""The job spec: the issue's example validates; every rule's error names the field."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from trainer_core.spec import JobSpec, SpecError, load_spec_file, parse_spec, untrainable_errors

EXAMPLE: dict[str, Any] = {
    "name": "reviews-minilm",
    "task": "text-classification",
    "model": {"name_or_path": "/path/to/local/model/dir"},
    "dataset": {
        "path": "csv",
        "data_files": {"train": "/data/train.csv", "validation": "/data/validation.csv"},
        "text_column": "text",
        "label_column": "label",
    },
    "preprocessing": {"max_length": 64},
    "training": {
        "backend": "accelerate",
        "num_train_epochs": 2,
        "per_device_train_batch_size": 16,
        "per_device_eval_batch_size": 32,
        "learning_rate": 5e-5,
        "weight_decay": 0.01,
        "lr_scheduler_type": "linear",
        "warmup_ratio": 0.0,
        "seed": 42,
        "logging_steps": 5,
        "eval_strategy": "epoch",
        "save_steps": 50,
        "save_total_limit": 2,
    },
    "optimizer": {"name": "adamw_8bit"},
    "efficiency": {
        "gradient_accumulation_steps": 2,
        "gradient_checkpointing": True,
        "mixed_precision": "bf16",
        "local_sgd_steps": None,
    },
    "resources": {"num_processes": 1},
    "metrics": ["accuracy", "f1"],
}


def with_change(path: str, value: Any) -> dict[str, Any]:
    return with_changes({path: value})


def with_changes(changes: dict[str, Any]) -> dict[str, Any]:
    """EXAMPLE with each dotted ``path: value`` set (``_DELETE`` removes the field)."""
    doc = copy.deepcopy(EXAMPLE)
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        node = doc
        for key in parents:
            node = node.setdefault(key, {})
        if value is _DELETE:
            node.pop(leaf, None)
        else:
            node[leaf] = value
    return doc


_DELETE = object()


def error_fields(doc: dict[str, Any]) -> list[str]:
    with pytest.raises(SpecError) as info:
        parse_spec(doc)
    return [e.field for e in info.value.errors]


def test_issue_example_validates_with_its_values() -> None:
    spec = parse_spec(EXAMPLE)
    assert spec.training.backend == "accelerate"
    assert spec.optimizer.name == "adamw_8bit"
    assert spec.efficiency.gradient_accumulation_steps == 2
    assert spec.metrics == ["accuracy", "f1"]
    # round trip: what the API stores is what the worker reads back
    assert JobSpec.model_validate(spec.model_dump(mode="json")) == spec


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        ("task", "token-classification", "task"),
        ("optimizer.name", "sgd", "optimizer.name"),
        ("efficiency.mixed_precision", "fp8", "efficiency.mixed_precision"),
        ("training.backend", "deepspeed", "training.backend"),
        ("training.per_device_train_batch_size", 0, "training.per_device_train_batch_size"),
        ("training.learning_rate", -1.0, "training.learning_rate"),
        ("efficiency.gradient_accumulation_steps", 0, "efficiency.gradient_accumulation_steps"),
        ("resources.num_processes", 0, "resources.num_processes"),
        ("resources.gpu_memory_gb", -3, "resources.gpu_memory_gb"),
        ("dataset.eval_fraction", 1.5, "dataset.eval_fraction"),
        ("metrics", ["accuracy", "bleu"], "metrics.1"),
        ("metrics", [], "metrics"),
        ("name", "bad name with spaces", "name"),
        ("preprocessing.max_length", 1, "preprocessing.max_length"),
    ],
)
def test_bad_value_names_its_field(path: str, value: Any, field: str) -> None:
    assert field in error_fields(with_change(path, value))


@pytest.mark.parametrize(
    ("doc_path", "value", "field"),
    [
        ("training.colour", "blue", "training.colour"),
        ("optimizer.lr", 0.1, "optimizer.lr"),
        ("surprise", 1, "surprise"),
    ],
)
def test_unknown_fields_are_rejected_not_ignored(doc_path: str, value: Any, field: str) -> None:
    assert field in error_fields(with_change(doc_path, value))


def test_local_sgd_needs_the_accelerate_backend() -> None:
    doc = with_change("efficiency.local_sgd_steps", 4)
    doc["training"]["backend"] = "trainer"
    with pytest.raises(SpecError) as info:
        parse_spec(doc)
    (err,) = info.value.errors
    assert err.field == "efficiency.local_sgd_steps"
    assert "accelerate" in err.message
    assert parse_spec(with_change("efficiency.local_sgd_steps", 4)).efficiency.local_sgd_steps == 4


SHARDED: dict[str, Any] = {"efficiency.sharding": "fsdp", "resources.num_processes": 2, "optimizer.name": "adamw"}


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        ("resources.num_processes", 1, "resources.num_processes"),
        ("training.backend", "trainer", "training.backend"),
        ("optimizer.name", "adamw_8bit", "optimizer.name"),
        ("optimizer.name", "adafactor", "optimizer.name"),
        ("efficiency.mixed_precision", "fp16", "efficiency.mixed_precision"),
        ("efficiency.local_sgd_steps", 2, "efficiency.local_sgd_steps"),
        ("adapter", {"type": "lora"}, "adapter"),
        ("efficiency.sharding", "none", "efficiency.fsdp"),  # options without sharding
    ],
)
def test_what_sharding_cannot_run_is_refused_naming_the_field(path: str, value: Any, field: str) -> None:
    assert error_fields(with_changes({**SHARDED, "efficiency.fsdp": {"strategy": "shard_grad_op"}, path: value})) == [
        field
    ]


def test_a_sharded_spec_validates_with_its_defaults() -> None:
    spec = parse_spec(with_changes(SHARDED))
    assert spec.fsdp_settings is not None
    assert (spec.fsdp_settings.strategy, spec.fsdp_settings.cpu_offload) == ("full_shard", False)
    assert parse_spec(EXAMPLE).fsdp_settings is None


def test_model_needs_exactly_one_source() -> None:
    assert error_fields(with_change("model", {})) == ["model.name_or_path"]
    both = {"name_or_path": "x", "config": {"model_type": "bert"}}
    assert error_fields(with_change("model", both)) == ["model.name_or_path"]
    assert error_fields(with_change("model", {"config": {"hidden_size": 8}})) == ["model.config.model_type"]


def test_dataset_needs_exactly_one_source_and_one_eval_rule() -> None:
    assert error_fields(with_change("dataset.path", _DELETE)) == ["dataset.path"]
    doc = with_change("dataset.eval_split", "test")
    doc["dataset"]["eval_fraction"] = 0.1
    assert error_fields(doc) == ["dataset.eval_fraction"]


def test_optimizer_fields_must_belong_to_the_chosen_optimizer() -> None:
    doc = with_change("optimizer", {"name": "adafactor", "adam_beta1": 0.8})
    assert error_fields(doc) == ["optimizer.adam_beta1"]
    doc = with_change("optimizer", {"name": "adamw", "adafactor_beta1": 0.9})
    assert error_fields(doc) == ["optimizer.adafactor_beta1"]
    doc = with_change("optimizer", {"name": "adamw_8bit", "amsgrad": True})
    assert error_fields(doc) == ["optimizer.amsgrad"]
    assert parse_spec(with_change("optimizer", {"name": "adamw", "amsgrad": True})).optimizer.amsgrad


def test_eval_steps_only_with_the_steps_strategy() -> None:
    assert error_fields(with_change("training.eval_steps", 10)) == ["training.eval_steps"]
    doc = with_change("training.eval_steps", 10)
    doc["training"]["eval_strategy"] = "steps"
    assert parse_spec(doc).training.eval_steps == 10


def test_processor_and_tokenizer_match_the_modality() -> None:
    assert error_fields(with_change("model.processor", "some/processor")) == ["model.processor"]
    doc = with_change("task", "image-classification")
    doc["model"]["tokenizer"] = "bert-base-uncased"
    assert error_fields(doc) == ["model.tokenizer"]


def test_spec_files_load_from_yaml_and_json(tmp_path: Path) -> None:
    import yaml

    (tmp_path / "spec.json").write_text(json.dumps(EXAMPLE))
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(EXAMPLE))
    assert load_spec_file(tmp_path / "spec.json") == load_spec_file(tmp_path / "spec.yaml")
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(SpecError) as info:
        load_spec_file(tmp_path / "broken.json")
    assert info.value.errors[0].field == "spec"
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(SpecError):
        load_spec_file(tmp_path / "list.yaml")


def test_union_type_markers_do_not_appear_in_field_paths() -> None:
    doc = with_change("dataset.data_files", {"train": 5})
    fields = error_fields(doc)
    assert fields and all(f.startswith("dataset.data_files") for f in fields)
    assert not any("str" in f.split(".") or "[" in f for f in fields)


LLM: dict[str, Any] = {
    "name": "sft",
    "task": "causal-lm",
    "model": {"name_or_path": "meta-llama/Llama-3.2-1B"},
    "dataset": {"path": "json", "prompt_column": "question", "completion_column": "answer"},
    "preprocessing": {"max_length": 2048, "train_on_prompt": False, "packing": True},
    "efficiency": {"mixed_precision": "bf16"},
    "adapter": {"type": "qlora", "r": 16, "alpha": 32, "dropout": 0.05, "target_modules": "all-linear"},
}


def llm_change(path: str, value: Any) -> dict[str, Any]:
    doc = copy.deepcopy(LLM)
    *parents, leaf = path.split(".")
    node = doc
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return doc


def test_causal_lm_spec_with_qlora_validates_with_its_values() -> None:
    spec = parse_spec(LLM)
    assert spec.task == "causal-lm" and spec.adapter is not None
    assert (spec.adapter.type, spec.adapter.r, spec.adapter.alpha, spec.adapter.target_modules) == (
        "qlora", 16, 32.0, "all-linear"
    )  # fmt: skip
    assert spec.adapter.double_quant is True and spec.adapter.compute_dtype == "bf16"
    assert spec.dataset.prompt_column == "question" and spec.dataset.messages_column == "messages"
    assert spec.preprocessing.packing and not spec.preprocessing.train_on_prompt
    # defaults: no adapter is a full fine-tune; packing and train_on_prompt are off
    plain = parse_spec({**LLM, "adapter": None, "preprocessing": {}})
    assert plain.adapter is None and not plain.preprocessing.packing and not plain.preprocessing.train_on_prompt
    assert JobSpec.model_validate(spec.model_dump()) == spec  # a dumped spec validates again unchanged


def test_adapters_are_allowed_on_classification_tasks() -> None:
    spec = parse_spec({**EXAMPLE, "adapter": {"type": "lora", "target_modules": ["query", "value"]}})
    assert spec.adapter is not None and spec.adapter.target_modules == ["query", "value"]


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        ("adapter.type", "dora", "adapter.type"),
        ("adapter.r", 0, "adapter.r"),
        ("adapter.dropout", 1.0, "adapter.dropout"),
        ("adapter.target_modules", [], "adapter.target_modules"),
        ("adapter.target_modules", "all", "adapter.target_modules"),
        ("adapter.rank", 8, "adapter.rank"),
        ("adapter.compute_dtype", "fp16", "adapter.compute_dtype"),  # bf16 autocast with fp16 4-bit matmuls
        ("efficiency.mixed_precision", "fp16", "adapter.compute_dtype"),
        ("task", "text-generation", "task"),
    ],
)
def test_bad_llm_value_names_its_field(path: str, value: Any, field: str) -> None:
    assert set(error_fields(llm_change(path, value))) == {field}  # a union reports each member


def test_qlora_fields_do_not_apply_to_lora() -> None:
    doc = llm_change("adapter", {"type": "lora", "double_quant": False})
    assert error_fields(doc) == ["adapter.double_quant"]


@pytest.mark.parametrize("name", ["packing", "train_on_prompt"])
def test_llm_preprocessing_only_for_causal_lm(name: str) -> None:
    assert error_fields(with_change(f"preprocessing.{name}", True)) == [f"preprocessing.{name}"]


def test_causal_lm_takes_a_tokenizer_not_a_processor() -> None:
    assert error_fields(llm_change("model.processor", "x")) == ["model.processor"]
    assert parse_spec(llm_change("model.tokenizer", "x")).model.tokenizer == "x"


def test_only_qlora_in_fp16_without_cuda_is_untrainable() -> None:
    assert untrainable_errors(parse_spec(LLM), cuda=False) == []
    fp16 = parse_spec(llm_change("adapter.compute_dtype", "fp16") | {"efficiency": {"mixed_precision": "no"}})
    assert [e.field for e in untrainable_errors(fp16, cuda=False)] == ["adapter.compute_dtype"]
    assert untrainable_errors(fp16, cuda=True) == []
    assert untrainable_errors(parse_spec(EXAMPLE), cuda=False) == []


def test_merging_a_qlora_adapter_is_refused_naming_the_field() -> None:
    assert error_fields(llm_change("adapter.merge", True)) == ["adapter.merge"]
    lora = {**LLM, "adapter": {"type": "lora", "merge": True}}
    adapter = parse_spec(lora).adapter
    assert adapter is not None and adapter.merge


def test_the_run_accepts_causal_lm_at_validation() -> None:
    from trainer_core.run import check_runnable

    check_runnable(parse_spec({**LLM, "adapter": None}))  # raises SpecError if refused


def test_the_checkpointing_section_sets_the_training_fields_the_run_reads() -> None:
    doc = copy.deepcopy(EXAMPLE)
    del doc["training"]["save_steps"], doc["training"]["save_total_limit"]
    doc["checkpointing"] = {"save_steps": 20, "save_total_limit": 1, "keep_best": True, "metric": "accuracy",
                            "greater_is_better": True}  # fmt: skip
    training = parse_spec(doc).training
    assert (training.save_steps, training.save_total_limit, training.keep_best_checkpoint) == (20, 1, True)
    assert (training.best_metric, training.best_higher_is_better, training.keeps_best) == ("eval_accuracy", True, True)
    stored = parse_spec(doc).model_dump(mode="json", exclude_unset=True)
    assert parse_spec(stored).training == training  # a stored spec (both places, equal) reads back the same
    doc["training"]["save_steps"] = 30
    assert error_fields(doc) == ["checkpointing.save_steps"]  # given twice, differently
    doc["training"]["save_steps"] = 20
    doc["checkpointing"]["metric"] = "bleu"
    assert error_fields(doc) == ["checkpointing.metric"]  # named where it was written
    doc["checkpointing"] = {"save_steps": 0}
    assert error_fields(doc) == ["checkpointing.save_steps"]


@pytest.mark.parametrize(
    ("init_from", "field"),
    [({}, "init_from.job"), ({"job": "a/b"}, "init_from.job"),
     ({"job": "abc", "checkpoint": -1}, "init_from.checkpoint"),
     ({"job": "abc", "checkpoint": "first"}, "init_from.checkpoint"), ({"path": "x", "extra": 1}, "init_from.extra")],
)  # fmt: skip
def test_init_from_names_a_job_or_a_path(init_from: dict[str, Any], field: str) -> None:
    assert error_fields({**EXAMPLE, "init_from": init_from}) == [field]
    assert parse_spec({**EXAMPLE, "init_from": {"job": "abc"}}).init_from.checkpoint == "last"  # type: ignore[union-attr]


def test_preference_methods_take_their_defaults_and_evaluate_rewards() -> None:
    spec = parse_spec({**LLM, "method": "dpo", "preprocessing": {"max_prompt_length": 64}})
    settings = spec.preference_settings  # TRL's DPOConfig defaults when the section is left out
    assert spec.is_preference and (settings.beta, settings.loss_type, settings.reference) == (0.1, "sigmoid", "base")
    assert "eval_rewards/accuracies" in spec.evaluation_metrics() and "eval_perplexity" not in spec.evaluation_metrics()
    best = parse_spec({**LLM, "method": "orpo", "preprocessing": {},
                       "training": {"metric_for_best_model": "rewards/accuracies"}})  # fmt: skip
    assert best.training.best_metric == "eval_rewards/accuracies" and best.training.best_higher_is_better
    assert not parse_spec(LLM).is_preference and parse_spec(LLM).method == "sft"


@pytest.mark.parametrize(
    ("changes", "field"),
    [({"task": "text-classification", "method": "dpo", "model": {"name_or_path": "m"}, "dataset": EXAMPLE["dataset"]},
      "method"),
     ({"preference": {"beta": 0.2}}, "preference"),  # a preference section on an SFT job
     ({"method": "orpo", "preference": {"reference": "precomputed"}}, "preference.reference"),
     ({"method": "orpo", "preference": {"loss_type": "ipo"}}, "preference.loss_type"),
     ({"method": "dpo", "preference": {"loss_type": "hinge", "label_smoothing": 0.1}}, "preference.label_smoothing"),
     ({"method": "dpo", "preference": {"beta": 0}}, "preference.beta"),
     ({"method": "kto"}, "method"),
     ({"method": "dpo", "preprocessing": {"packing": True}}, "preprocessing.packing"),
     ({"method": "dpo", "preprocessing": {"train_on_prompt": True}}, "preprocessing.train_on_prompt"),
     ({"preprocessing": {"max_prompt_length": 64}}, "preprocessing.max_prompt_length"),
     ({"method": "dpo", "training": {"metric_for_best_model": "perplexity", "keep_best_checkpoint": True}},
      "training.metric_for_best_model")],
)  # fmt: skip
def test_preference_refusals_name_their_field(changes: dict[str, Any], field: str) -> None:
    doc = {**copy.deepcopy(LLM), "preprocessing": {}, **changes}
    if doc["task"] != "causal-lm":
        doc.pop("adapter"), doc.pop("efficiency")
        doc["preprocessing"] = {}
    assert error_fields(doc) == [field]


def test_the_lighter_loss_settings_are_causal_lm_only_and_liger_needs_cuda() -> None:
    for name in ("chunked_loss", "liger"):
        assert error_fields(with_change(f"efficiency.{name}", True)) == [f"efficiency.{name}"]
    assert error_fields(llm_change("efficiency", {"chunked_loss": True, "liger": True})) == ["efficiency.chunked_loss"]
    liger = parse_spec(llm_change("efficiency", {"mixed_precision": "bf16", "liger": True}))
    assert [e.field for e in untrainable_errors(liger, cuda=False)] == ["efficiency.liger"]
    assert untrainable_errors(liger, cuda=True) == []
    assert untrainable_errors(parse_spec(llm_change("efficiency", {"chunked_loss": True})), cuda=False) == []
