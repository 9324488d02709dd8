"""Preflight on this machine: what passes (every format and modality) and how a big file is read only in part."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from tests.trainer_core import datagen
from trainer_core.data.peek import HEAD_BYTES, HEAD_ROWS
from trainer_core.preflight import PreflightError, preflight, preflight_key
from trainer_core.spec import parse_spec
from trainjobs.cli import main


def test_image_and_audio_folders_pass_with_their_labels(tmp_path: Path) -> None:
    images = datagen.write_image_folder(tmp_path / "img", n_train_per_class=3, n_val_per_class=1)
    report = preflight(parse_spec(datagen.tiny_image_spec(images)))
    assert report.labels == ["blue", "green", "red"] and "media_decodes" in report.checks
    assert report.splits == {"train": {"rows": 9, "exact": True}, "validation": {"rows": 3, "exact": True}}
    audio = datagen.write_audio_folder(tmp_path / "aud", n_train_per_class=2, n_val_per_class=1)
    report = preflight(parse_spec(datagen.tiny_audio_spec(audio)))
    assert report.labels == ["high", "low"] and report.model == {"model": "config"}


def test_json_lines_and_parquet_are_read_like_csv(tmp_path: Path) -> None:
    rows = [{"text": f"review {i}", "label": i % 3} for i in range(30)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    pd.DataFrame(rows).to_parquet(tmp_path / "train.parquet")
    for builder, name in (("json", "train.jsonl"), ("parquet", "train.parquet")):
        spec = datagen.tiny_text_spec({"train": str(tmp_path / name)}, dataset={"path": builder, "eval_fraction": 0.2})
        report = preflight(parse_spec(spec))
        assert report.labels == ["0", "1", "2"]
        assert report.splits["train"] == {"rows": 24, "exact": True}  # 30 rows, ceil(0.2 x 30) held out
        assert report.splits["eval_fraction"] == {"rows": 6, "exact": True}


def test_a_big_file_is_read_in_part_and_a_sorted_label_column_is_not_refused(tmp_path: Path) -> None:
    # Labels sorted: the first HEAD_ROWS rows all say "a". Only reading on would show the "b"s.
    n = 60_000
    frame = pd.DataFrame({"text": ["some words that make the file big enough"] * n,
                          "label": ["a"] * (n - 10) + ["b"] * 10})  # fmt: skip
    frame.to_csv(tmp_path / "big.csv", index=False)
    assert (tmp_path / "big.csv").stat().st_size > HEAD_BYTES
    report = preflight(parse_spec(datagen.tiny_text_spec({"train": str(tmp_path / "big.csv")})))
    train = report.splits["train"]
    assert train["exact"] is False and abs(train["rows"] - n) < n * 0.05  # estimated from the bytes
    assert report.labels is None and any(f"first {HEAD_ROWS} train rows" in note for note in report.notes)


def test_eval_labels_unseen_in_train_are_refused(tmp_path: Path) -> None:
    (tmp_path / "train.csv").write_text("text,label\ngood,pos\nbad,neg\n")
    (tmp_path / "val.csv").write_text("text,label\nmeh,neutral\n")
    spec = datagen.tiny_text_spec({"train": str(tmp_path / "train.csv"), "validation": str(tmp_path / "val.csv")})
    with pytest.raises(PreflightError) as info:
        preflight(parse_spec(spec))
    assert [e.field for e in info.value.errors] == ["dataset.label_column"]
    assert "neutral" in info.value.errors[0].message


def test_validate_command_prints_the_report_or_the_fields(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = datagen.write_sentiment_csv(tmp_path / "data", n_train=16, n_val=8)
    good = tmp_path / "good.json"
    good.write_text(json.dumps(datagen.tiny_text_spec(files)))
    assert main(["validate", str(good)]) == 0
    assert json.loads(capsys.readouterr().out)["labels"] == ["negative", "positive"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(datagen.tiny_text_spec(files, dataset={"text_column": "body"})))
    assert main(["validate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dataset.text_column: column 'body' not found") and "text, label" in err


def test_train_command_stops_before_training_with_the_runs_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = datagen.tiny_text_spec({"train": str(tmp_path / "nowhere.csv")})
    path = tmp_path / "job.json"
    path.write_text(json.dumps(spec))
    assert main(["train", str(path), "--output-dir", str(tmp_path / "out"), "--jsonl"]) == 2
    done = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert done["event"] == "done" and done["summary"]["reason"] == "data_error"
    assert not (tmp_path / "out").exists()


def test_compressed_json_lines_are_read(tmp_path: Path) -> None:
    import gzip

    rows = [{"text": f"review {i}", "label": i % 2} for i in range(10)]
    with gzip.open(tmp_path / "train.jsonl.gz", "wt") as fh:
        fh.write("\n".join(json.dumps(r) for r in rows))
    spec = datagen.tiny_text_spec({"train": str(tmp_path / "train.jsonl.gz")}, dataset={"path": "json"})
    assert preflight(parse_spec(spec)).labels == ["0", "1"]


def test_remote_data_files_are_left_to_the_run(tmp_path: Path) -> None:
    spec = datagen.tiny_text_spec({"train": "https://example.org/train.csv"})
    report = preflight(parse_spec(spec))
    assert "data_files" not in report.checks and report.notes == ["remote data files: not read before the run"]


def test_preflight_key_follows_the_files_it_reads(tmp_path: Path) -> None:
    train = tmp_path / "train.csv"
    train.write_text("text,label\ngood,pos\nbad,neg\n")
    spec = parse_spec(datagen.tiny_text_spec({"train": str(train)}))
    key = preflight_key(spec)
    assert key is not None and preflight_key(spec) == key
    assert preflight_key(spec.model_copy(update={"name": "another-name"})) == key  # not read by preflight
    train.write_text("text,label\ngood,pos\nbad,neg\nfine,pos\n")
    assert preflight_key(spec) != key  # changed file: checked again
    train.unlink()
    assert preflight_key(spec) is None  # missing file: preflight itself must say so
    pattern = parse_spec(datagen.tiny_text_spec({"train": str(tmp_path / "*.csv")}))
    assert preflight_key(pattern) is None  # a glob may match other files next time


def test_preference_pairs_are_counted_and_refused_by_their_fields(tmp_path: Path) -> None:
    from tests.trainer_core.llm_data import lm_spec, write_lm_tokenizer, write_preference_jsonl

    tokenizer = write_lm_tokenizer(tmp_path / "tok")
    chat = write_preference_jsonl(tmp_path / "chat", "chat", n_train=20)
    spec = lm_spec(chat, tokenizer, method="dpo", preprocessing={"max_length": 6, "max_prompt_length": 4})
    report = preflight(parse_spec(spec))
    assert "preference_pairs" in report.checks and report.splits["train"]["rows"] == 20
    counts = report.truncation
    assert counts is not None and counts["rows"] == 20 and counts["prompt_cut"] == 20  # every prompt is > 4 tokens
    assert counts["truncated"] >= counts["answer_cut"] > 0 and any("truncation" in note for note in report.notes)
    roomy = preflight(parse_spec({**spec, "preprocessing": {"max_length": 64}})).truncation
    assert roomy == {"rows": 20, "prompt_cut": 0, "answer_cut": 0, "truncated": 0, "dropped": 0}

    no_template = write_lm_tokenizer(tmp_path / "plain", chat_template=False)
    with pytest.raises(PreflightError) as refused:
        preflight(parse_spec(lm_spec(chat, no_template, method="orpo")))
    assert [e.field for e in refused.value.errors] == ["model.tokenizer"]
    renamed = lm_spec(chat, tokenizer, method="dpo", dataset={"path": "json", "data_files": chat, "chosen_column": "a"})
    with pytest.raises(PreflightError) as missing:
        preflight(parse_spec(renamed))
    assert [e.field for e in missing.value.errors] == ["dataset.chosen_column"]
