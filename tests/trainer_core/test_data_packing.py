"""Packing's parts on their own: best-fit-decreasing rows (and their fill against greedy packing), the
packed rows' labels and positions, and the collator's two layouts (rows with a block-diagonal mask,
or one flattened sequence for flash attention)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig

from trainer_core.data.causal_lm import IGNORE_INDEX
from trainer_core.data.packing import PackedCollator, Packer, best_fit_rows, packing_error, packing_layout


def greedy_rows(lengths: list[int], max_length: int) -> list[list[int]]:
    """Rows filled in data order, a new one when the next example does not fit (trainjobs' former rule)."""
    rows: list[list[int]] = []
    used = max_length + 1
    for index, length in enumerate(lengths):
        if used + length > max_length:
            rows.append([])
            used = 0
        rows[-1].append(index)
        used += length
    return rows


def fill(rows: list[list[int]], lengths: list[int], max_length: int) -> float:
    """Tokens over the positions the rows offer: 1.0 is no padding."""
    return sum(lengths) / (len(rows) * max_length)


def test_best_fit_puts_each_example_in_the_tightest_row_that_holds_it() -> None:
    # Longest first: 7 opens row 0 (3 left), 5 opens row 1 (5 left), 4 takes row 1 (the only fit),
    # 3 fills row 0 exactly, 2 fits nowhere (1 left in row 1) and opens row 2.
    assert best_fit_rows([5, 3, 7, 2, 4], 10) == [[2, 1], [0, 4], [3]]


def test_an_example_longer_than_a_row_gets_a_row_of_its_own() -> None:
    assert best_fit_rows([12, 3, 4], 10) == [[0], [2, 1]]


def test_best_fit_decreasing_fills_rows_better_than_greedy_on_varied_lengths() -> None:
    rng = random.Random(0)
    max_length = 256
    # Chat-like lengths: many short examples and a long tail, cut at max_length as the encoders do.
    lengths = [min(max_length, max(4, round(rng.lognormvariate(4.0, 0.8)))) for _ in range(1000)]
    bfd, greedy = best_fit_rows(lengths, max_length), greedy_rows(lengths, max_length)
    assert sorted(i for row in bfd for i in row) == list(range(len(lengths))), "every example once"
    assert all(sum(lengths[i] for i in row) <= max_length for row in bfd)
    # Measured here (seed 0): BFD 0.997, greedy 0.807.
    assert fill(bfd, lengths, max_length) > 0.98 > 0.9 > fill(greedy, lengths, max_length)


def test_packer_restarts_positions_and_masks_each_examples_first_label() -> None:
    batch = {"input_ids": [[1, 2, 3], [4, 5], [6, 7, 8, 9]], "labels": [[1, 2, 3], [-100, 5], [6, 7, 8, 9]]}
    out = Packer(6)(batch)
    assert out["input_ids"] == [[6, 7, 8, 9, 4, 5], [1, 2, 3]]
    assert out["labels"] == [[IGNORE_INDEX, 7, 8, 9, IGNORE_INDEX, 5], [IGNORE_INDEX, 2, 3]]
    assert out["position_ids"] == [[0, 1, 2, 3, 0, 1], [0, 1, 2]]
    assert out["length"] == [6, 3]


ROWS = [
    {"input_ids": [5, 6, 7, 8], "labels": [-100, 6, -100, 8], "position_ids": [0, 1, 0, 1]},
    {"input_ids": [9, 10], "labels": [-100, 10], "position_ids": [0, 1]},
]
# Row 0: two examples of 2 tokens. Row 1: one example, then 2 positions of padding (its own block).
ALLOWED = torch.tensor([
    [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]],
    [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 1]],
], dtype=torch.bool)  # fmt: skip


def test_rows_keep_their_shape_with_a_block_diagonal_causal_mask() -> None:
    batch = PackedCollator(pad_token_id=0, attn_implementation="sdpa")(ROWS)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8], [9, 10, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, -100, 8], [-100, 10, -100, -100]]
    assert batch["position_ids"].tolist() == [[0, 1, 0, 1], [0, 1, 0, 0]]
    mask = batch["attention_mask"]
    assert mask.dtype == torch.bool and mask.shape == (2, 1, 4, 4)
    assert torch.equal(mask[:, 0], ALLOWED)


def test_eager_attention_gets_the_same_mask_as_additive_floats() -> None:
    mask = PackedCollator(pad_token_id=0, attn_implementation="eager")(ROWS)["attention_mask"]
    assert mask.dtype == torch.float32
    assert torch.equal(mask[:, 0] == 0, ALLOWED)
    assert torch.all(mask[:, 0][~ALLOWED] == torch.finfo(torch.float32).min)


def test_flash_attention_gets_one_flattened_sequence_without_a_mask() -> None:
    batch = PackedCollator(pad_token_id=0, attn_implementation="flash_attention_2")(ROWS)
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 10]]
    assert batch["position_ids"].tolist() == [[0, 1, 0, 1, 0, 1]]


def test_the_layout_follows_the_attention_implementation() -> None:
    assert packing_layout("sdpa") == packing_layout("eager") == "rows"
    assert packing_layout("flash_attention_2") == packing_layout("flash_attention_3") == "flattened"
    with pytest.raises(ValueError, match="flex_attention"):
        packing_layout("flex_attention")
    config = LlamaConfig(attn_implementation="eager")
    assert PackedCollator(0).for_model(config) == PackedCollator(0, "eager")
    assert packing_error(config) is None
    assert "flex_attention" in str(packing_error(LlamaConfig(attn_implementation="flex_attention")))


def test_an_unbound_collator_refuses_to_guess_the_mask_format() -> None:
    with pytest.raises(RuntimeError, match="for_model"):
        PackedCollator(0)(ROWS)
