"""``trainjobs train``: JSON lines or a progress bar, exit 0 only on success, 2 for a spec that cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from tests.trainer_core.runhelpers import text_spec
from trainer_core.events import parse_event_line
from trainjobs.cli import main


def tiny_spec_file(tmp_path: Path, suffix: str = ".yaml", **overrides: object) -> Path:
    spec = text_spec(tmp_path / "data", "accelerate", n_train=16, n_val=8,
                     training={"max_steps": 4, "logging_steps": 2, "per_device_train_batch_size": 8}, **overrides)
    path = tmp_path / f"spec{suffix}"
    data = spec.model_dump(mode="json")
    path.write_text(yaml.safe_dump(data) if suffix == ".yaml" else json.dumps(data))
    return path


def test_jsonl_prints_one_event_per_line_and_exits_0(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec_file = tiny_spec_file(tmp_path, ".json")
    code = main(["train", str(spec_file), "--output-dir", str(tmp_path / "out"), "--jsonl"])
    assert code == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    events = [parse_event_line(line) for line in lines]
    assert all(e is not None for e in events), [ln for ln, e in zip(lines, events, strict=True) if e is None]
    kinds = [e["event"] for e in events if e is not None]
    assert kinds[-1] == "done" and {"progress", "metric", "memory", "eval"} <= set(kinds)
    assert (tmp_path / "out" / "model.safetensors").is_file()


def test_progress_bar_shows_loss_on_a_yaml_spec(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec_file = tiny_spec_file(tmp_path, ".yaml")
    code = main(["train", str(spec_file), "--output-dir", str(tmp_path / "out")])
    captured = capsys.readouterr()
    assert code == 0
    assert "loss=" in captured.err and "4/4" in captured.err  # tqdm bar with the live loss
    assert "succeeded" in captured.err
    assert not any(parse_event_line(line) for line in captured.out.splitlines())


def test_invalid_spec_prints_field_and_message_and_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec_file = tiny_spec_file(tmp_path, ".json")
    data = json.loads(spec_file.read_text())
    data["training"]["per_device_train_batch_size"] = 0
    spec_file.write_text(json.dumps(data))
    code = main(["train", str(spec_file), "--output-dir", str(tmp_path / "out")])
    assert code == 2
    assert "training.per_device_train_batch_size:" in capsys.readouterr().err


def test_fp16_on_cpu_exits_2_suggesting_bf16(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    spec_file = tiny_spec_file(tmp_path, ".json", efficiency={"mixed_precision": "fp16"})
    code = main(["train", str(spec_file), "--output-dir", str(tmp_path / "out")])
    assert code == 2
    err = capsys.readouterr().err
    assert "efficiency.mixed_precision:" in err and "bf16" in err


def test_failed_run_exits_1_with_a_done_failed_event(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # hidden_size 30 is not a multiple of 4 heads: the model cannot be built, the run fails.
    bad_model = {"config": {"model_type": "bert", "vocab_size": 1000, "hidden_size": 30, "num_attention_heads": 4,
                            "num_hidden_layers": 1, "intermediate_size": 16}}
    spec_file = tiny_spec_file(tmp_path, ".json", model=bad_model)
    code = main(["train", str(spec_file), "--output-dir", str(tmp_path / "out"), "--jsonl"])
    assert code == 1
    events = [e for e in map(parse_event_line, capsys.readouterr().out.splitlines()) if e is not None]
    assert events[-1]["event"] == "done" and events[-1]["status"] == "failed"
    assert events[-1]["summary"]["reason"] == "model_error"


def test_missing_spec_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["train", str(tmp_path / "nope.yaml"), "--output-dir", str(tmp_path / "out")])
    assert code == 2
    assert capsys.readouterr().err.startswith("spec:")


def test_cancelled_run_exits_3_from_either_entry_point(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from trainer_core.cli import main as engine_main

    spec_file = tiny_spec_file(tmp_path, ".json")
    stop = tmp_path / "stop"
    stop.touch()  # asked to stop before the first step ends: the run stops after it, cancelled
    for entry, argv in ((main, ["train"]), (engine_main, [])):
        out = tmp_path / f"out-{len(argv)}"
        code = entry([*argv, str(spec_file), "--output-dir", str(out), "--jsonl", "--stop-file", str(stop)])
        events = [e for e in map(parse_event_line, capsys.readouterr().out.splitlines()) if e is not None]
        assert events[-1]["event"] == "done" and events[-1]["status"] == "cancelled"
        assert code == 3
