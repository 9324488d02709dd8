"""Training order: length grouping cuts padding, and the order depends only on (seed, epoch)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.trainer_core.runhelpers import BACKENDS, run, text_spec
from trainer_core.backends.sampling import EpochSampler, eval_order


def padded_tokens(order: list[int], lengths: list[int], batch: int) -> int:
    """Tokens a batch-padded run processes: every batch padded to its longest member."""
    return sum(max(lengths[i] for i in order[k:k + batch]) * len(order[k:k + batch])
               for k in range(0, len(order), batch))


def test_length_grouping_pads_far_less_than_random_order() -> None:
    rng = random.Random(0)
    lengths = [rng.randint(4, 128) for _ in range(512)]
    grouped = list(EpochSampler(len(lengths), seed=1, group_size=16, lengths=lengths))
    shuffled = list(EpochSampler(len(lengths), seed=1, group_size=16, lengths=None))
    assert sorted(grouped) == sorted(shuffled) == list(range(512))  # a permutation either way
    assert padded_tokens(grouped, lengths, 16) < 0.7 * padded_tokens(shuffled, lengths, 16)


def test_order_depends_only_on_seed_and_epoch() -> None:
    lengths = list(range(1, 101))
    sampler = EpochSampler(100, seed=3, group_size=8, lengths=lengths)
    sampler.set_epoch(2)
    again = EpochSampler(100, seed=3, group_size=8, lengths=lengths)
    again.set_epoch(2)
    assert list(sampler) == list(again)
    again.set_epoch(3)
    assert list(sampler) != list(again)


def test_eval_order_is_longest_first() -> None:
    assert eval_order([3, 9, 1, 5], 4) == [1, 3, 0, 2]
    assert eval_order(None, 3) == [0, 1, 2]


@pytest.mark.parametrize("backend", BACKENDS)
def test_eval_strategy_steps_evaluates_every_eval_steps(tmp_path: Path, backend: str) -> None:
    spec = text_spec(
        tmp_path / "data", backend, n_train=32, n_val=8,
        training={"max_steps": 6, "per_device_train_batch_size": 8, "eval_strategy": "steps", "eval_steps": 2},
    )
    status, events = run(spec, tmp_path / "out")
    assert status == "succeeded"
    assert [e["step"] for e in events.of_kind("eval")] == [2, 4, 6]
