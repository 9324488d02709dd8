"""Training order: length grouping cuts padding, and the order depends only on (seed, epoch)."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from transformers.trainer_pt_utils import get_length_grouped_indices

from tests.trainer_core.runhelpers import BACKENDS, run, text_spec
from trainer_core.backends import sampling
from trainer_core.backends.sampling import EpochSampler, eval_order, length_grouped_order


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


def review_like_lengths(n: int) -> list[int]:
    """Token counts like bench_training's reviews: log-normal, median ~25, a long tail to 256."""
    rng = random.Random(0)
    return [max(5, min(256, round(rng.lognormvariate(math.log(25), 1.0)))) for _ in range(n)]


def test_a_small_data_set_is_grouped_as_tightly_as_sorting_it_whole() -> None:
    """Trainer's recipe sorts a quarter of a small set at a time; we sort up to 50 steps' worth."""
    lengths = review_like_lengths(640)
    grouped = list(EpochSampler(len(lengths), seed=1, group_size=16, lengths=lengths))
    assert sorted(grouped) == list(range(640))
    whole = sorted(range(640), key=lambda i: -lengths[i])
    trainers = get_length_grouped_indices(lengths, 16, generator=torch.Generator().manual_seed(1))
    assert padded_tokens(grouped, lengths, 16) <= 1.02 * padded_tokens(whole, lengths, 16)
    assert padded_tokens(grouped, lengths, 16) < 0.9 * padded_tokens(trainers, lengths, 16)


def test_the_longest_input_goes_first_and_steps_do_not_walk_down_in_length() -> None:
    lengths = review_like_lengths(640)
    order = list(EpochSampler(len(lengths), seed=2, group_size=16, lengths=lengths))
    assert lengths[order[0]] == max(lengths)  # a run too big for memory fails at its first step
    maxima = [max(lengths[i] for i in order[k:k + 16]) for k in range(16, 640, 16)]
    assert maxima != sorted(maxima, reverse=True)  # the groups were shuffled, not left sorted


def test_a_partial_group_stays_last() -> None:
    """995 = 124 x 8 + 3: mega-batches of 400, 400 and 195; the 3 shortest of the last one trail."""
    lengths = review_like_lengths(995)
    order = length_grouped_order(lengths, 8, torch.Generator().manual_seed(0))
    assert sorted(order) == list(range(995))
    last_mega = set(order[-195:]) | {order[0]}  # order[0] may have swapped with one of them
    fourth_shortest = sorted(lengths[i] for i in last_mega)[3]
    assert all(lengths[i] <= fourth_shortest for i in order[-3:])
    assert length_grouped_order([], 8, torch.Generator()) == []


def test_the_longest_input_goes_first_when_only_a_short_last_group_holds_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Group 4, mega-batches of 8: the 2 inputs left over form a short last group. For the seeds
    that leave the longest input among them, it is swapped in alone (moving the group would break
    the grouping)."""
    monkeypatch.setattr(sampling, "MEGA_BATCH_STEPS", 2)
    lengths = [5] * 8 + [99, 1]
    for seed in range(10):
        order = length_grouped_order(lengths, 4, torch.Generator().manual_seed(seed))
        assert sorted(order) == list(range(10))
        assert lengths[order[0]] == 99


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
