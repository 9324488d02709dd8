"""``trainjobs estimate``: the table, the JSON object, the budget's plan, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from trainer_core.memory import TOTAL_FORMULA
from trainer_core.memory.estimator import human_bytes
from trainjobs import memory_table
from trainjobs.cli import main
from trainjobs.commands.estimate import parse_memory


def write_spec(tmp_path: Path, model: str, batch: int = 8) -> Path:
    spec = {
        "name": "cli-estimate",
        "task": "text-classification",
        "model": {"name_or_path": model},
        "dataset": {"path": "csv", "data_files": {"train": "train.csv"}},
        "training": {"per_device_train_batch_size": batch},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_table_lists_parts_and_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = write_spec(tmp_path, "bert-large-uncased", batch=32)
    assert main(["estimate", str(spec), "--gpu-memory", "8GiB"]) == 3  # only a plan entry fits
    out = capsys.readouterr().out
    for part in ("parameters", "gradients", "optimizer_state", "activations", "overhead", "total per device"):
        assert part in out
    assert "does NOT fit in 8.00 GiB" in out
    assert TOTAL_FORMULA in next(line for line in out.splitlines() if line.startswith("total per device"))
    assert "settings that fit, fastest first:" in out and "optimizer.name=adamw_8bit" in out


def test_the_lean_renderer_writes_sizes_as_the_estimator_does() -> None:
    # trainjobs.memory_table keeps its own human_bytes (the client cannot import torch): pin the two together.
    for n in (0, 1, 1023, 1024, 1536, 5 * 1024**2 + 7, 3 * 1024**3, 10**13, -2048):
        assert memory_table.human_bytes(n) == human_bytes(n), n


def test_json_has_the_headline_numbers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = write_spec(tmp_path, "distilbert-base-uncased")
    assert main(["estimate", str(spec), "--json", "--devices", "2", "--gpu-memory", "24"]) == 0  # fits
    payload = json.loads(capsys.readouterr().out)
    keys = ["parameters", "parameter_bytes", "gradient_bytes", "optimizer_state_bytes", "activation_bytes",
            "transient_bytes", "overhead_bytes", "total_bytes"]  # fmt: skip
    assert all(isinstance(payload[k], int) for k in keys)
    assert payload["devices"] == 2 and payload["ddp_bucket_bytes"] == payload["gradient_bytes"]
    assert payload["plan"]["budget_bytes"] == 24 * 1024**3 and payload["plan"]["entries"]


def test_unknown_model_exits_2_naming_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = write_spec(tmp_path, "nobody/unknown-model")
    assert main(["estimate", str(spec)]) == 2
    assert "model.name_or_path" in capsys.readouterr().err


def test_memory_sizes_parse_in_gib() -> None:
    assert parse_memory("24GiB") == 24
    assert parse_memory("80GB") == pytest.approx(80e9 / 1024**3)
    assert parse_memory("512MiB") == 0.5
    with pytest.raises(Exception, match="--gpu-memory"):
        parse_memory("lots")


def test_exit_status_says_whether_the_spec_a_plan_entry_or_nothing_fits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = str(write_spec(tmp_path, "bert-large-uncased", batch=32))
    assert main(["estimate", spec]) == 0  # no budget: nothing to fit
    assert main(["estimate", spec, "--gpu-memory", "80GiB"]) == 0
    assert main(["estimate", spec, "--gpu-memory", "8GiB"]) == 3
    capsys.readouterr()
    assert main(["estimate", spec, "--gpu-memory", "512MiB"]) == 4
    out = capsys.readouterr().out
    assert "does NOT fit" in out and "nothing fits; the smallest footprint is" in out


def test_an_auto_batch_is_estimated_as_chosen_for_the_budget(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = write_spec(tmp_path, "distilbert-base-uncased")
    data = yaml.safe_load(spec.read_text())
    data["training"] = {"per_device_train_batch_size": "auto", "num_train_epochs": "auto"}
    spec.write_text(yaml.safe_dump(data))
    assert main(["estimate", str(spec), "--json", "--gpu-memory", "12"]) == 0  # the chosen batch fits
    payload = json.loads(capsys.readouterr().out)
    (choice,) = payload["auto"]  # the epochs need the rows: they stay auto in a memory estimate
    assert choice["field"] == "training.per_device_train_batch_size" and "12.0 GiB" in choice["why"]
    assert payload["fits"] is True and payload["total_bytes"] <= 12 * 1024**3
    assert main(["estimate", str(spec), "--gpu-memory", "12"]) == 0
    assert f"training.per_device_train_batch_size = {choice['value']}" in capsys.readouterr().out


def test_the_time_part_is_the_services(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    spec = write_spec(tmp_path, "distilbert-base-uncased")
    assert main(["estimate", str(spec), "--train-rows", "1000"]) == 2  # no queue history here
    assert "--train-rows" in capsys.readouterr().err
    time = {"steps": 125, "train_samples": 3000, "tokens_per_sample": 128, "train_flops": 3e15, "eval_flops": 0.0,
            "seconds": 620.0, "seconds_p10": 400.0, "seconds_p90": 950.0, "cost": 0.41}  # fmt: skip
    lines = memory_table.render_time(time)
    assert "125 steps, 3000 training samples of 128 positions, 3e+03 TFLOP" in lines[0]
    assert lines[1] == "  predicted 620 s (p10-p90 400-950 s), cost 0.41"
