"""Planner entries fit by the estimator's own numbers, keep the effective batch, come fastest first."""

from __future__ import annotations

from tests.trainer_core.memory.conftest import SpecFactory
from trainer_core.memory import estimate_memory, plan_memory
from trainer_core.memory.planner import SHARDING_TIERS, apply_changes

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
    plan = plan_memory(spec, 4)  # below even a 4-bit base of 8B parameters
    assert plan.entries == []
    smallest = estimate_memory(apply_changes(spec, plan.minimum_changes)).total_bytes
    assert smallest == plan.minimum_total_bytes > 4 * GIB
    assert plan.minimum_changes["adapter"]["type"] == "qlora"
    assert plan.minimum_changes["training.per_device_train_batch_size"] < 4


LLAMA_SFT = {"max_length": 2048}


def test_llama_8b_on_24_gib_gets_fitting_qlora_entries(make_spec: SpecFactory) -> None:
    spec = make_spec(
        "meta-llama/Meta-Llama-3-8B", task="causal-lm", preprocessing=LLAMA_SFT,
        training={"per_device_train_batch_size": 4}, efficiency={"mixed_precision": "bf16"},
    )  # fmt: skip
    plan = plan_memory(spec, 24)
    full = [e for e in plan_memory(spec, 24).entries if e.spec.adapter is None]
    assert full == [] and not estimate_memory(spec, gpu_memory_gb=24).fits
    kinds = [(e.spec.adapter.type, e.spec.adapter.r) for e in plan.entries if e.spec.adapter is not None]
    assert ("qlora", 16) in kinds
    assert kinds == sorted(kinds, key=lambda k: (k[0] != "lora", k[1]))  # LoRA first, then QLoRA; rank 8/16/64
    for entry in plan.entries:  # never an entry that does not fit
        assert estimate_memory(entry.spec).total_bytes == entry.estimate_total_bytes <= 24 * GIB
        assert entry.spec == apply_changes(spec, entry.changes)
        assert entry.reason.endswith("of 24.00 GiB")
    qlora = next(e for e in plan.entries if e.spec.adapter is not None and e.spec.adapter.type == "qlora")
    assert "QLORA r=8 adapter" in qlora.reason


def test_adapters_are_offered_only_when_the_spec_does_not_fit(make_spec: SpecFactory) -> None:
    spec = make_spec("meta-llama/Llama-3.2-1B", task="causal-lm", preprocessing={"max_length": 256})
    plan = plan_memory(spec, 80)
    assert plan.entries and all(e.spec.adapter is None for e in plan.entries)
    # a LoRA spec that does not fit is offered QLoRA, never a full fine-tune
    lora = make_spec(
        "meta-llama/Meta-Llama-3-8B", task="causal-lm", preprocessing=LLAMA_SFT,
        adapter={"type": "lora"}, efficiency={"mixed_precision": "bf16"},
    )  # fmt: skip
    entries = plan_memory(lora, 12).entries
    assert entries and {e.spec.adapter.type for e in entries if e.spec.adapter} == {"qlora"}
    assert all(e.spec.adapter is not None for e in entries)


def test_switching_optimizer_keeps_valid_hyper_parameters(make_spec: SpecFactory) -> None:
    spec = make_spec("text", optimizer={"name": "adamw", "amsgrad": True, "adam_beta2": 0.98})
    eight = apply_changes(spec, {"optimizer.name": "adamw_8bit", "optimizer.amsgrad": False})
    assert eight.optimizer.adam_beta2 == 0.98 and not eight.optimizer.amsgrad
    ada = apply_changes(spec, {"optimizer.name": "adafactor", "optimizer.amsgrad": False})
    assert ada.optimizer.name == "adafactor" and ada.optimizer.adam_beta2 == 0.999


def test_the_oom_ladder_drops_a_dpo_reference_copy_before_anything_else() -> None:
    from trainer_core.memory.planner import next_oom_changes
    from trainer_core.spec import parse_spec

    doc = {"name": "dpo", "task": "causal-lm", "method": "dpo", "model": {"name_or_path": "meta-llama/Llama-3.2-1B"},
           "dataset": {"path": "json"}, "training": {"per_device_train_batch_size": 4}}  # fmt: skip
    halved = {"training.per_device_train_batch_size": 2, "efficiency.gradient_accumulation_steps": 2}
    full = parse_spec(doc)
    assert next_oom_changes(full) == {"preference.reference": "precomputed"}  # the same losses, one copy less
    assert next_oom_changes(apply_changes(full, {"preference.reference": "precomputed"})) == halved
    # An adapter's reference is the base with the adapter off, ORPO has none, SFT keeps its ladder.
    for changed in ({"adapter": {"type": "lora"}}, {"method": "orpo"}, {"method": "sft"}):
        assert next_oom_changes(parse_spec({**doc, **changed})) == halved, changed


def test_a_full_fine_tune_of_8b_on_8_x_80_gib_is_offered_sharding(make_spec: SpecFactory) -> None:
    """Unsharded, no setting of Llama-3-8B's full fine-tune fits 80 GiB (weights, gradients and AdamW state
    alone are 16 B a parameter); sharded over 8 processes it does, and those entries come before adapters."""
    spec = make_spec(
        "meta-llama/Meta-Llama-3-8B", task="causal-lm", preprocessing=LLAMA_SFT,
        training={"per_device_train_batch_size": 4}, efficiency={"mixed_precision": "bf16"},
        resources={"num_processes": 8},
    )  # fmt: skip
    plan = plan_memory(spec, 80)
    sharded = [e for e in plan.entries if e.spec.fsdp_settings is not None]
    modes = [(e.spec.fsdp_settings.strategy, e.spec.fsdp_settings.cpu_offload) for e in sharded if e.spec.fsdp_settings]
    assert modes == [("shard_grad_op", False), ("full_shard", False), ("full_shard", True)]
    assert plan.entries[: len(sharded)] == sharded  # a full fine-tune kept before any adapter
    for entry in sharded:
        assert entry.spec.adapter is None and entry.spec.training.backend == "accelerate"
        assert estimate_memory(entry.spec).total_bytes == entry.estimate_total_bytes <= 80 * GIB
        assert entry.spec == apply_changes(spec, entry.changes)
        assert "FSDP" in entry.reason and "over 8 processes" in entry.reason
    unsharded = [e for e in plan.entries if e.spec.adapter is None and e.spec.fsdp_settings is None]
    assert unsharded == []
    # on one process there is nothing to shard over
    single = make_spec("meta-llama/Meta-Llama-3-8B", task="causal-lm", preprocessing=LLAMA_SFT,
                       efficiency={"mixed_precision": "bf16"})  # fmt: skip
    assert all(e.spec.fsdp_settings is None for e in plan_memory(single, 80).entries)


def test_the_oom_ladder_of_a_sharded_job_offers_only_what_sharding_runs(make_spec: SpecFactory) -> None:
    from trainer_core.memory.planner import next_oom_changes

    spec = make_spec("text", training={"backend": "accelerate", "per_device_train_batch_size": 1},
                     efficiency={"sharding": "fsdp", "gradient_checkpointing": True},
                     resources={"num_processes": 2})  # fmt: skip
    # at the bottom of the batch and checkpointing rungs, an unsharded job would switch to adamw_8bit
    assert next_oom_changes(spec.model_copy(update={"efficiency": spec.efficiency.model_copy(
        update={"sharding": "none"})})) == {"optimizer.name": "adamw_8bit"}  # fmt: skip
    assert next_oom_changes(spec) is None


def test_a_full_fine_tune_too_big_for_one_node_sharded_is_offered_the_fewest_nodes_that_fit(
    make_spec: SpecFactory,
) -> None:
    """Llama-3-8B's full fine-tune sharded over one node of 8 processes needs more than 16 GiB a device
    (its weights, gradients and AdamW state alone are 16 GB a rank), unless the shards go to host memory.
    With machines to spare (``max_nodes``: the queue's workers) it is offered sharded over more nodes,
    the fewest that fit, before that offload and before any adapter."""
    spec = make_spec(
        "meta-llama/Meta-Llama-3-8B", task="causal-lm", preprocessing=LLAMA_SFT,
        training={"per_device_train_batch_size": 4}, efficiency={"mixed_precision": "bf16"},
        resources={"num_processes": 8},
    )  # fmt: skip
    one_node = [e for e in plan_memory(spec, 16).entries if e.spec.fsdp_settings is not None]
    assert [e.spec.fsdp_settings.cpu_offload for e in one_node if e.spec.fsdp_settings] == [True]
    plan = plan_memory(spec, 16, max_nodes=8)
    spread = [e for e in plan.entries if e.spec.resources.num_nodes > 1]
    # (shard_grad_op, which keeps each block gathered from its forward to its backward, needs more)
    assert [(e.spec.resources.num_nodes, e.spec.fsdp_settings.strategy) for e in spread if e.spec.fsdp_settings] == [
        (4, "full_shard")]  # fmt: skip
    assert plan.entries[: len(spread) + 1] == [*spread, one_node[0]]  # then the offload, then adapters
    for entry in spread:
        assert entry.spec.adapter is None and entry.spec.world_size == 32
        assert estimate_memory(entry.spec).total_bytes == entry.estimate_total_bytes <= 16 * GIB
        assert entry.spec == apply_changes(spec, entry.changes)
        assert "over 32 processes" in entry.reason and "4 nodes of 8 processes" in entry.reason
    # two nodes would not have been enough; with no machine to spare, none is offered
    two = apply_changes(spec, {"resources.num_nodes": 2, **SHARDING_TIERS[1]})
    assert estimate_memory(two).total_bytes > 16 * GIB
    assert all(e.spec.resources.num_nodes == 1 for e in plan_memory(spec, 16, max_nodes=3).entries[:1])
