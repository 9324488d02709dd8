"""The meta-device structure is exact, cached and fast; unknown models fail clearly."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.trainer_core.memory.conftest import TINY_CONFIGS, SpecFactory
from trainer_core.memory import UnknownModelError, estimate_memory
from trainer_core.memory.parameters import (
    ModelStructure,
    StructureCache,
    cached_structure,
    model_structure,
    structure_cache_info,
)
from trainer_core.modeling import build_model
from trainer_core.spec import ModelSpec


@pytest.mark.parametrize("kind", sorted(TINY_CONFIGS))
def test_tensor_shapes_match_instantiated_model(make_spec: SpecFactory, kind: str) -> None:
    spec = make_spec(kind)
    labels = [str(i) for i in range(3)]
    model = build_model(spec.task, spec.model, labels)
    structure = model_structure(spec.model, spec.task, num_labels=3)
    assert [(t.name, t.shape) for t in structure.tensors] == [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert estimate_memory(spec).parameters == sum(p.numel() for p in model.parameters())


def test_local_directory_is_read_from_disk(minilm_path: Path, make_spec: SpecFactory) -> None:
    spec = make_spec(str(minilm_path))
    model = build_model(spec.task, spec.model, ["neg", "pos"])
    estimate = estimate_memory(spec)
    assert estimate.parameters == sum(p.numel() for p in model.parameters())
    assert estimate.parameter_bytes == 4 * estimate.parameters  # fp32 master weights
    assert estimate.model == str(minilm_path.resolve())


def test_num_labels_come_from_config_or_keyword(make_spec: SpecFactory) -> None:
    spec = make_spec("text")  # the tiny config says num_labels=3
    three = estimate_memory(spec).parameters
    five = estimate_memory(spec, num_labels=5).parameters
    assert five - three == 2 * (64 + 1)  # two more rows of the 64-wide classifier, with bias
    catalog = estimate_memory(make_spec("bert-base-uncased")).parameters
    assert catalog == 109_483_778  # BERT-base with the default 2-label head


def test_unknown_hub_id_offline_is_a_clear_error(make_spec: SpecFactory) -> None:
    with pytest.raises(UnknownModelError) as info:
        estimate_memory(make_spec("some-org/not-a-catalog-model"))
    (error,) = info.value.errors
    assert error.field == "model.name_or_path"
    assert "some-org/not-a-catalog-model" in error.message and "offline" in error.message


def test_structure_is_cached_and_warm_estimate_is_fast(make_spec: SpecFactory) -> None:
    spec = make_spec("meta-llama/Meta-Llama-3-8B")
    estimate_memory(spec)  # cold: builds on meta
    hits = structure_cache_info().hits
    start = time.perf_counter()
    for _ in range(20):
        estimate_memory(spec)
    warm = (time.perf_counter() - start) / 20
    assert structure_cache_info().hits == hits + 20
    assert warm < 0.005, f"warm estimate took {warm * 1000:.2f} ms"


def test_simultaneous_first_estimates_build_the_model_once(make_spec: SpecFactory) -> None:
    # A config no other test uses, so the first of these calls is a cache miss.
    config = {**TINY_CONFIGS["text"][1], "intermediate_size": 136, "num_labels": 5}
    spec = make_spec("text").model_copy(update={"model": ModelSpec(config=config)})
    before = structure_cache_info()
    barrier = threading.Barrier(6)

    def first_estimate() -> int:
        barrier.wait()
        return estimate_memory(spec).total_bytes

    with ThreadPoolExecutor(6) as pool:
        totals = list(pool.map(lambda _: first_estimate(), range(6)))
    after = structure_cache_info()
    assert len(set(totals)) == 1
    assert (after.misses - before.misses, after.hits - before.hits) == (1, 5)


def test_peek_never_builds_and_the_cache_drops_the_least_recently_used(make_spec: SpecFactory) -> None:
    config = {**TINY_CONFIGS["text"][1], "intermediate_size": 144}
    spec = make_spec("text").model_copy(update={"model": ModelSpec(config=config)})
    misses = structure_cache_info().misses
    assert cached_structure(spec.model, spec.task) is None
    assert structure_cache_info().misses == misses  # peeking built nothing
    built = model_structure(spec.model, spec.task)
    assert cached_structure(spec.model, spec.task) is built

    cache = StructureCache(maxsize=2)
    made: list[str] = []

    def builder(name: str) -> Callable[[], ModelStructure]:
        def build() -> ModelStructure:
            made.append(name)
            return built

        return build

    a, b, c = ((("config", name), "text-classification", None) for name in "abc")
    cache.get(a, builder("a"))
    cache.get(b, builder("b"))
    cache.get(a, builder("a"))  # a is now the most recently used
    cache.get(c, builder("c"))  # drops b
    assert (cache.peek(a), cache.peek(b), cache.peek(c)) == (built, None, built)
    assert made == ["a", "b", "c"] and cache.info().size == 2


def test_estimate_memoizes_per_optimizer_setting(make_spec: SpecFactory) -> None:
    adamw = make_spec("text")
    amsgrad = make_spec("text", optimizer={"name": "adamw", "amsgrad": True})
    first, second = estimate_memory(adamw), estimate_memory(amsgrad)
    # The memo is keyed by what the optimizer formula reads: amsgrad's third moment shows.
    moments = first.trainable_parameters * 4
    assert second.optimizer_state_bytes - first.optimizer_state_bytes == moments
    assert estimate_memory(adamw).optimizer_state_bytes == first.optimizer_state_bytes


def test_master_weights_are_fp32_even_when_the_config_names_bf16(make_spec: SpecFactory) -> None:
    spec = make_spec("text")
    bf16 = spec.model_copy(update={"model": ModelSpec(config={**TINY_CONFIGS["text"][1], "dtype": "bfloat16"})})
    model = build_model(bf16.task, bf16.model, ["a", "b", "c"])
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    estimate = estimate_memory(bf16)
    assert estimate.parameter_bytes == 4 * estimate.parameters == 4 * sum(p.numel() for p in model.parameters())
