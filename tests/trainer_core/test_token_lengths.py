"""A sample's positions from the data's own lengths (trainer_core/token_lengths.py): padding as the run
batches, packing, the real MiniLM tokenizer's counts (a dry run's time estimate takes them:
tests/api/test_time_estimate.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from datasets import Dataset

from tests.trainer_core.datagen import tiny_text_spec
from trainer_core.backends import sampling
from trainer_core.preflight import preflight
from trainer_core.spec import JobSpec, parse_spec
from trainer_core.token_lengths import MEGA_BATCH_STEPS, measured_lengths, sample_tokens

FILES = {"train": "/data/train.csv"}


def spec_of(**sections: object) -> JobSpec:
    return parse_spec(tiny_text_spec(FILES, **sections))


def test_the_mega_batch_is_the_samplers() -> None:
    assert MEGA_BATCH_STEPS == sampling.MEGA_BATCH_STEPS


def test_grouped_padding_pads_each_sorted_micro_batch_to_its_longest() -> None:
    spec = spec_of(training={"per_device_train_batch_size": 2}, preprocessing={"max_length": 64})
    # One mega-batch: sorted 9 7 | 5 4 | 1 -> padded 9 9 5 5 1: a mean of 29/5 positions.
    assert sample_tokens(spec, [4, 9, 1, 7, 5]).tokens == pytest.approx(29 / 5)
    assert sample_tokens(spec, [100, 3]).tokens == pytest.approx(64)  # truncated at max_length first


def test_random_batches_pad_to_the_expected_longest_of_the_draw() -> None:
    spec = spec_of(training={"per_device_train_batch_size": 2}, preprocessing={"group_by_length": False})
    # E[max of 2 draws from {1, 2, 3, 4}] = (1x1 + 2x3 + 3x5 + 4x7) / 16
    assert sample_tokens(spec, [1, 2, 3, 4]).tokens == pytest.approx(50 / 16)
    assert sample_tokens(spec, [5, 5, 5]).tokens == pytest.approx(5)


def test_packing_counts_the_rows_best_fit_decreasing_packs_and_their_padding() -> None:
    packed = parse_spec({
        "name": "lm", "task": "causal-lm", "model": {"name_or_path": "/models/llama"},
        "dataset": {"path": "json", "data_files": {"train": "/data/lm.json"}},
        "preprocessing": {"max_length": 64, "packing": True},
    })  # fmt: skip
    # 200 is cut to 64 and fills a row; best-fit decreasing puts 30, 20 and 10 in a second one, of 60.
    counted = sample_tokens(packed, [10, 20, 30, 200])
    assert counted.samples_per_row == 2 / 4
    # Length-grouped batches of B=8 packed rows pad to their longest: both rows share one, of 64.
    assert counted.tokens == 64.0


def test_the_real_tokenizer_counts_and_preflight_reports_them(minilm_path: Path, tmp_path: Path) -> None:
    texts = ["short", "a somewhat longer review of the film", "great " * 80]
    (tmp_path / "train.csv").write_text("text,label\n" + "".join(f"{t},{i % 2}\n" for i, t in enumerate(texts)))
    files = {"train": str(tmp_path / "train.csv")}
    spec = parse_spec(tiny_text_spec(files, minilm_path, preprocessing={"max_length": 32},
                                     training={"per_device_train_batch_size": 1}))  # fmt: skip
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    want = [min(len(tokenizer(t)["input_ids"]), 32) for t in texts]
    assert measured_lengths(spec, Dataset.from_dict({"text": texts, "label": [0, 1, 0]})) == want
    report = preflight(spec)
    assert report.sample_tokens == {"tokens": pytest.approx(sum(want) / 3), "samples_per_row": 1.0, "rows_measured": 3}
    config_built = parse_spec(tiny_text_spec({"train": str(tmp_path / "train.csv")}))  # trains its own tokenizer
    assert measured_lengths(config_built, Dataset.from_dict({"text": texts, "label": [0, 1, 0]})) is None
