"""Preference rows (method dpo/orpo): which tokens count (the answers only), chat rendering as TRL's,
truncation order (prompt first, from its start; then the answer's end), dropped rows, the collator's
chosen-then-rejected batch, refusals naming their field, and a cache key apart from SFT's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tests.trainer_core.llm_data import lm_spec, preference_rows, write_lm_tokenizer, write_preference_jsonl
from trainer_core.data import PreparedData, prepare_data
from trainer_core.data.cache import cache_key
from trainer_core.data.causal_lm import IGNORE_INDEX
from trainer_core.data.preference import PreferenceCollator, PreferenceEncoder, count_truncation, truncate_pair
from trainer_core.data.text import ready_for_lm
from trainer_core.preflight import PreflightError, preflight
from trainer_core.spec import JobSpec, SpecError, parse_spec
from trainer_core.token_lengths import measured_lengths


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_lm_tokenizer(tmp_path_factory.mktemp("tok") / "tokenizer")


@pytest.fixture(scope="module")
def tok(tokenizer_dir: Path) -> PreTrainedTokenizerBase:
    return ready_for_lm(AutoTokenizer.from_pretrained(str(tokenizer_dir)), str(tokenizer_dir))


def _spec(files: dict[str, str], tokenizer: Path, **pre: Any) -> JobSpec:
    return parse_spec(lm_spec(files, tokenizer, method="dpo", preprocessing={"max_length": 64, **pre}))


def _data(tmp: Path, shape: str, tokenizer: Path, **pre: Any) -> tuple[PreparedData, list[dict[str, Any]]]:
    files = write_preference_jsonl(tmp / shape, shape, n_train=8, n_val=2)
    raw = [json.loads(line) for line in Path(files["train"]).read_text(encoding="utf-8").splitlines()]
    return prepare_data(_spec(files, tokenizer, **pre), None), raw


def _ids(tok: PreTrainedTokenizerBase, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def test_text_pairs_count_only_the_answer_and_its_eos(tmp_path: Path, tokenizer_dir: Path, tok: Any) -> None:
    data, raw = _data(tmp_path, "text", tokenizer_dir)
    assert len(data.train) == len(raw)
    for row, source in zip(data.train, raw, strict=True):
        prompt = [tok.cls_token_id, *_ids(tok, source["prompt"])]
        for side in ("chosen", "rejected"):
            answer = [*_ids(tok, source[side]), tok.sep_token_id]  # [SEP]: the BERT-style tokenizer's eos
            assert row[f"{side}_input_ids"] == prompt + answer
            assert row[f"{side}_labels"] == [IGNORE_INDEX] * len(prompt) + answer
        assert row["length"] == max(len(row["chosen_input_ids"]), len(row["rejected_input_ids"]))


def test_chat_pairs_are_rendered_as_trl_renders_them(tmp_path: Path, tokenizer_dir: Path, tok: Any) -> None:
    data, raw = _data(tmp_path, "chat", tokenizer_dir)
    for row, source in zip(data.train, raw, strict=True):
        # TRL: the prompt with the generation prompt; the answer is the rest of prompt + answer's rendering.
        prompt_text = tok.apply_chat_template(source["prompt"], tokenize=False, add_generation_prompt=True)
        prompt = _ids(tok, prompt_text)
        assert prompt[0] == tok.cls_token_id and prompt_text.endswith("assistant:")
        for side in ("chosen", "rejected"):
            full = tok.apply_chat_template(source["prompt"] + source[side], tokenize=False)
            answer = _ids(tok, full[len(prompt_text) :])
            assert row[f"{side}_input_ids"] == prompt + answer
            assert row[f"{side}_labels"] == [IGNORE_INDEX] * len(prompt) + answer
            assert tok.decode(answer, skip_special_tokens=True) == source[side][0]["content"]


def test_chat_answers_may_be_plain_strings_and_cells_json(tok: Any) -> None:
    """A string answer is one assistant turn; CSV holds the turns as JSON strings."""
    row = preference_rows("chat", 1)[0]
    as_turns = PreferenceEncoder(tok, "prompt", "chosen", "rejected", 64)({k: [v] for k, v in row.items()})
    csv_like = {
        "prompt": [json.dumps(row["prompt"])],
        "chosen": [row["chosen"][0]["content"]],
        "rejected": [json.dumps(row["rejected"])],
    }
    assert PreferenceEncoder(tok, "prompt", "chosen", "rejected", 64)(csv_like) == as_turns


def test_truncation_cuts_the_prompt_start_first_then_the_answer_end() -> None:
    head, prompt, chosen, rejected = [0], [1, 2, 3, 4, 5], [10, 11, 12], [20, 21]
    # max_prompt_length keeps the prompt's last tokens (the head counts and is kept).
    assert truncate_pair(head, prompt, (chosen, rejected), 100, 3) == ([4, 5], (chosen, rejected), True, False)
    # Too long together: the prompt loses its start so that it fits beside the longer answer.
    assert truncate_pair(head, prompt, (chosen, rejected), 7, None) == ([3, 4, 5], (chosen, rejected), True, False)
    # No prompt left to cut: the answers lose their end.
    assert truncate_pair(head, prompt, (chosen, rejected), 3, None) == ([], ([10, 11], [20, 21]), True, True)
    assert truncate_pair(head, prompt, (chosen, rejected), 9, None) == (prompt, (chosen, rejected), False, False)


def test_prepared_rows_keep_within_the_limits(tmp_path: Path, tokenizer_dir: Path, tok: Any) -> None:
    data, raw = _data(tmp_path, "text", tokenizer_dir, max_length=12, max_prompt_length=4)
    assert any(len(_ids(tok, r["prompt"])) > 3 for r in raw), "some prompts must be cut"
    for row, source in zip(data.train, raw, strict=True):
        prompt = _ids(tok, source["prompt"])
        for side in ("chosen", "rejected"):
            ids, labels = row[f"{side}_input_ids"], row[f"{side}_labels"]
            context = labels.count(IGNORE_INDEX)
            answer = [*_ids(tok, source[side]), tok.sep_token_id]
            assert len(ids) <= 12 and ids[0] == tok.cls_token_id and context <= 4  # [CLS] is never cut
            kept = ids[1:context]
            assert kept == prompt[len(prompt) - len(kept) :]  # the prompt's last tokens
            assert ids[context:] == answer[: len(ids) - context]  # the answer's first tokens


def test_rows_whose_answer_keeps_no_target_are_dropped_and_counted(tok: Any) -> None:
    rows = {"prompt": ["how was it?"], "chosen": [" good."], "rejected": [" bad."]}
    fits = PreferenceEncoder(tok, "prompt", "chosen", "rejected", 64).pairs(rows)[0]
    assert fits.trainable and not (fits.prompt_cut or fits.answer_cut)
    # Only the head is left room: the answer keeps no token, so the row teaches nothing.
    cut = PreferenceEncoder(tok, "prompt", "chosen", "rejected", 1).pairs(rows)[0]
    assert not cut.trainable and cut.prompt_cut and cut.answer_cut


def test_count_truncation_reports_prompt_and_answer_cuts(tokenizer_dir: Path, tok: Any) -> None:
    long_prompt = "tell me about " + " ".join(["the film"] * 10) + "?"
    rows = {
        "prompt": ["how was it?", long_prompt, "how was it?"],
        "chosen": [" good.", " good.", " good" + ", really good" * 10 + "."],
        "rejected": [" bad.", " bad.", " bad."],
    }
    spec = _spec({"train": "unused.jsonl"}, tokenizer_dir, max_length=16, max_prompt_length=8)
    counts = count_truncation(spec, tok, rows, max_length=16)
    assert counts.as_dict() == {"rows": 3, "prompt_cut": 2, "answer_cut": 1, "truncated": 2, "dropped": 0}


def test_collator_stacks_chosen_then_rejected_right_padded() -> None:
    features = [
        {"chosen_input_ids": [1, 2, 3], "chosen_labels": [-100, 2, 3], "rejected_input_ids": [1, 4],
         "rejected_labels": [-100, 4], "ref_chosen_logps": -1.5, "ref_rejected_logps": -2.5},
        {"chosen_input_ids": [1, 5], "chosen_labels": [-100, 5], "rejected_input_ids": [1, 6, 7, 8],
         "rejected_labels": [-100, 6, 7, 8], "ref_chosen_logps": -3.0, "ref_rejected_logps": -4.0},
    ]  # fmt: skip
    batch = PreferenceCollator(pad_token_id=0)(features)
    assert batch["input_ids"].tolist() == [[1, 2, 3, 0], [1, 5, 0, 0], [1, 4, 0, 0], [1, 6, 7, 8]]
    assert batch["labels"].tolist() == [
        [-100, 2, 3, -100], [-100, 5, -100, -100], [-100, 4, -100, -100], [-100, 6, 7, 8]
    ]  # fmt: skip
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1]]
    assert batch["ref_chosen_logps"].tolist() == [-1.5, -3.0] and batch["ref_rejected_logps"].dtype == torch.float32
    plain = [{k: v for k, v in f.items() if not k.startswith("ref_")} for f in features]
    assert set(PreferenceCollator(pad_token_id=0)(plain)) == {"input_ids", "labels", "attention_mask"}


def test_prepared_data_gives_the_preference_collator(tmp_path: Path, tokenizer_dir: Path) -> None:
    data, _ = _data(tmp_path, "text", tokenizer_dir)
    assert isinstance(data.collator, PreferenceCollator)
    batch = data.collator([data.train[0], data.train[1]])
    assert batch["input_ids"].shape[0] == 4 and batch["labels"].shape == batch["input_ids"].shape


@pytest.mark.parametrize("missing", ["chosen", "rejected", "prompt"])
def test_a_missing_column_names_its_field(tmp_path: Path, tokenizer_dir: Path, missing: str) -> None:
    rows = [{k: v for k, v in r.items() if k != missing} for r in preference_rows("text", 4)]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    with pytest.raises(SpecError) as exc:
        prepare_data(_spec({"train": str(path)}, tokenizer_dir), None)
    assert exc.value.errors[0].field == f"dataset.{missing}_column"
    assert repr(missing) in exc.value.errors[0].message


def test_renamed_columns_are_read(tmp_path: Path, tokenizer_dir: Path) -> None:
    names = {"prompt": "question", "chosen": "good", "rejected": "bad"}
    rows = [{names[k]: v for k, v in r.items()} for r in preference_rows("text", 4)]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    raw = lm_spec({"train": str(path)}, tokenizer_dir, method="orpo")
    raw["dataset"].update(prompt_column="question", chosen_column="good", rejected_column="bad")
    assert len(prepare_data(parse_spec(raw), None).train) == 4


def test_chat_rows_need_a_chat_template(tmp_path: Path) -> None:
    plain = write_lm_tokenizer(tmp_path / "plain", chat_template=False)
    files = write_preference_jsonl(tmp_path / "chat", "chat", n_train=4, n_val=2)
    with pytest.raises(SpecError) as exc:
        prepare_data(_spec(files, plain), None)
    assert exc.value.errors[0].field == "model.tokenizer" and "chat template" in exc.value.errors[0].message


def test_cache_key_keeps_preference_rows_apart_from_sft(tokenizer_dir: Path) -> None:
    files = {"train": "train.jsonl"}
    sft = parse_spec(lm_spec(files, tokenizer_dir))
    dpo = _spec(files, tokenizer_dir)
    renamed = parse_spec(lm_spec(files, tokenizer_dir, method="dpo", dataset={"path": "json", "data_files": files,
                                                                           "chosen_column": "good"}))  # fmt: skip
    keys = {cache_key(spec, {}) for spec in (sft, dpo, renamed)}
    assert len(keys) == 3


def test_measured_lengths_of_a_pair_are_both_padded_rows(tmp_path: Path, tokenizer_dir: Path, tok: Any) -> None:
    from datasets import Dataset

    rows = preference_rows("text", 3)
    spec = _spec({"train": "unused.jsonl"}, tokenizer_dir)
    encoded = PreferenceEncoder(tok, "prompt", "chosen", "rejected", 64)(Dataset.from_list(rows)[:])
    assert measured_lengths(spec, Dataset.from_list(rows)) == [2 * n for n in encoded["length"]]


def test_a_cache_hit_serves_the_same_pairs(tmp_path: Path, tokenizer_dir: Path) -> None:
    files = write_preference_jsonl(tmp_path / "text", "text", n_train=4, n_val=2)
    first = prepare_data(_spec(files, tokenizer_dir), tmp_path / "cache")
    again = prepare_data(_spec(files, tokenizer_dir), tmp_path / "cache")
    assert (first.cache_hit, again.cache_hit) == (False, True)
    assert again.train[:] == first.train[:] and isinstance(again.collator, PreferenceCollator)


def test_preflight_reads_the_preference_columns(tmp_path: Path, tokenizer_dir: Path) -> None:
    files = write_preference_jsonl(tmp_path / "chat", "chat", n_train=4, n_val=2)
    report = preflight(_spec(files, tokenizer_dir))
    assert "columns" in report.checks and report.sample_tokens is not None
    raw = lm_spec(files, tokenizer_dir, method="orpo")
    raw["dataset"]["rejected_column"] = "worse"
    with pytest.raises(PreflightError) as exc:
        preflight(parse_spec(raw))
    assert [e.field for e in exc.value.errors] == ["dataset.rejected_column"]
