"""Text data: tokenisation without padding, dynamic padding, label mapping, splits, bad columns."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest

from tests.trainer_core.datagen import tiny_text_spec, write_sentiment_csv
from trainer_core.data import PreparedData, load_processor, prepare_data
from trainer_core.spec import JobSpec, SpecError, parse_spec


def _write_csv(path: Path, header: list[str], rows: list[list[Any]]) -> str:
    with path.open("w", newline="", encoding="utf-8") as fh:
        writer = csv.writer(fh)
        writer.writerow(header)
        writer.writerows(rows)
    return str(path)


def _prepare(spec: dict[str, Any]) -> PreparedData:
    return prepare_data(parse_spec(spec), None)


@pytest.fixture
def sentiment_files(tmp_path: Path) -> dict[str, str]:
    return write_sentiment_csv(tmp_path / "csv", n_train=40, n_val=10)


def test_minilm_tokenizes_unpadded_and_collator_pads_to_batch_longest(
    sentiment_files: dict[str, str], minilm_path: Path
) -> None:
    data = _prepare(tiny_text_spec(sentiment_files, minilm_path))

    assert data.labels == ["negative", "positive"]
    assert data.eval is not None and len(data.train) == 40 and len(data.eval) == 10
    assert set(data.train.column_names) == {"input_ids", "token_type_ids", "attention_mask", "labels", "length"}
    lengths = data.train["length"]
    assert lengths == [len(ids) for ids in data.train["input_ids"]]
    assert len(set(lengths)) > 1, "rows must keep their own length (no padding in preprocessing)"
    # write_sentiment_csv alternates positive (even rows) and negative.
    assert data.train["labels"][:4] == [1, 0, 1, 0]

    rows = [data.train[i] for i in range(6)]
    batch = data.collator(rows)
    assert set(batch) == {"input_ids", "token_type_ids", "attention_mask", "labels"}
    assert batch["input_ids"].shape == (6, max(r["length"] for r in rows))
    assert batch["attention_mask"].sum(dim=1).tolist() == [r["length"] for r in rows]
    assert batch["labels"].tolist() == [r["labels"] for r in rows]
    assert data.processor.decode(rows[0]["input_ids"], skip_special_tokens=True) in Path(
        sentiment_files["train"]
    ).read_text(encoding="utf-8")


def test_max_length_truncates(sentiment_files: dict[str, str], minilm_path: Path) -> None:
    data = _prepare(tiny_text_spec(sentiment_files, minilm_path, preprocessing={"max_length": 8}))
    assert max(data.train["length"]) == 8


def test_config_model_trains_its_own_tokenizer_within_vocab(sentiment_files: dict[str, str]) -> None:
    data = _prepare(tiny_text_spec(sentiment_files))
    tokenizer = data.processor
    assert len(tokenizer) <= 1000
    assert tokenizer.pad_token_id == 0
    ids = tokenizer("the movie was wonderful")["input_ids"]
    assert tokenizer.unk_token_id not in ids
    assert tokenizer.convert_ids_to_tokens(ids) == ["[CLS]", "the", "movie", "was", "wonderful", "[SEP]"]
    assert max(max(row) for row in data.train["input_ids"]) < 1000


def test_load_processor_needs_texts_for_config_model_and_trains_on_them(sentiment_files: dict[str, str]) -> None:
    spec = parse_spec(tiny_text_spec(sentiment_files))
    with pytest.raises(ValueError, match="train_texts"):
        load_processor(spec)
    tokenizer = load_processor(spec, ["zebra zebra quokka"] * 5)
    assert "quokka" in tokenizer.get_vocab()


def test_text_pair_column_gets_segment_ids(tmp_path: Path) -> None:
    rows = [[f"question {i}", f"answer number {i} is here", "yes" if i % 2 else "no"] for i in range(12)]
    files = {"train": _write_csv(tmp_path / "pairs.csv", ["q", "a", "label"], rows)}
    spec = tiny_text_spec(
        files, dataset={"text_column": "q", "text_pair_column": "a", "eval_fraction": 0.25}
    )
    data = _prepare(spec)
    row = data.train[0]
    assert 0 in row["token_type_ids"] and 1 in row["token_type_ids"]
    assert data.processor.decode(row["input_ids"]).count("[SEP]") == 2


def test_integer_labels_sort_numerically(tmp_path: Path) -> None:
    rows = [[f"sample {i}", label] for i, label in enumerate([10, 2, 1, 2, 10, 1, 1, 2])]
    files = {"train": _write_csv(tmp_path / "train.csv", ["text", "label"], rows)}
    data = _prepare(tiny_text_spec(files))
    assert data.labels == ["1", "2", "10"]
    assert data.train["labels"] == [2, 1, 0, 1, 2, 0, 0, 1]
    assert data.eval is None


def test_eval_label_missing_from_train_is_a_spec_error(tmp_path: Path) -> None:
    files = {
        "train": _write_csv(tmp_path / "train.csv", ["text", "label"], [["a", "cat"], ["b", "dog"]]),
        "validation": _write_csv(tmp_path / "val.csv", ["text", "label"], [["c", "cat"], ["d", "bird"]]),
    }
    with pytest.raises(SpecError) as info:
        _prepare(tiny_text_spec(files))
    assert info.value.errors[0].field == "dataset.label_column"
    assert "bird" in str(info.value)


@pytest.mark.parametrize(
    ("dataset", "field"),
    [
        ({"text_column": "review"}, "dataset.text_column"),
        ({"label_column": "sentiment"}, "dataset.label_column"),
        ({"text_pair_column": "context"}, "dataset.text_pair_column"),
    ],
)
def test_unknown_column_names_the_field_and_lists_columns(
    sentiment_files: dict[str, str], dataset: dict[str, str], field: str
) -> None:
    with pytest.raises(SpecError) as info:
        _prepare(tiny_text_spec(sentiment_files, dataset=dataset))
    error = info.value.errors[0]
    assert error.field == field
    assert "text, label" in error.message


def _single_file_spec(tmp_path: Path, **dataset: Any) -> JobSpec:
    files = write_sentiment_csv(tmp_path / "single", n_train=40, n_val=1)
    return parse_spec(tiny_text_spec({"train": files["train"]}, dataset=dataset))


def test_eval_fraction_holds_out_a_seeded_split(tmp_path: Path) -> None:
    spec = _single_file_spec(tmp_path, eval_fraction=0.25)
    first, again = prepare_data(spec, None), prepare_data(spec, None)
    assert first.eval is not None and again.eval is not None
    assert (len(first.train), len(first.eval)) == (30, 10)
    assert first.eval["input_ids"] == again.eval["input_ids"]

    other_seed = spec.model_copy(update={"training": spec.training.model_copy(update={"seed": 7})})
    reseeded = prepare_data(other_seed, None)
    assert reseeded.eval is not None and reseeded.eval["input_ids"] != first.eval["input_ids"]


def test_no_validation_and_no_fraction_means_no_eval(tmp_path: Path) -> None:
    assert prepare_data(_single_file_spec(tmp_path), None).eval is None


def test_eval_split_picks_the_named_split_and_rejects_unknown_ones(tmp_path: Path) -> None:
    files = write_sentiment_csv(tmp_path / "csv", n_train=20, n_val=6)
    files["holdout"] = write_sentiment_csv(tmp_path / "other", n_train=8, n_val=1)["train"]
    data = _prepare(tiny_text_spec(files, dataset={"eval_split": "holdout"}))
    assert data.eval is not None and len(data.eval) == 8

    with pytest.raises(SpecError) as info:
        _prepare(tiny_text_spec(files, dataset={"eval_split": "dev"}))
    assert info.value.errors[0].field == "dataset.eval_split"
    assert "holdout" in info.value.errors[0].message


def test_test_split_is_the_eval_split_when_there_is_no_validation(tmp_path: Path) -> None:
    files = write_sentiment_csv(tmp_path / "csv", n_train=20, n_val=6)
    data = _prepare(tiny_text_spec({"train": files["train"], "test": files["validation"]}))
    assert data.eval is not None and len(data.eval) == 6


def test_missing_data_file_names_data_files(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as info:
        _prepare(tiny_text_spec({"train": str(tmp_path / "nope.csv")}))
    assert info.value.errors[0].field == "dataset.data_files"


def test_max_length_beyond_the_tokenizer_limit_is_capped(tmp_path: Path, minilm_path: Path) -> None:
    long_text = " ".join(["word"] * 2000)
    rows = [[long_text, "a"], ["short", "b"], [long_text, "b"], ["tiny", "a"]]
    files = {"train": _write_csv(tmp_path / "long.csv", ["text", "label"], rows)}
    data = _prepare(tiny_text_spec(files, minilm_path, preprocessing={"max_length": 4096}))
    limit = data.processor.model_max_length
    assert limit < 4096
    assert max(data.train["length"]) == limit
