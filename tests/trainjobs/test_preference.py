"""Preference tuning over HTTP on the live service: SFT with LoRA, then DPO from its last checkpoint;
the reward metrics stream and chart like the loss, the DPO adapter downloads and loads with PEFT; every
refusal is a 422 naming the field, at submit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import wait_finished
from tests.trainer_core.llm_data import lm_spec, write_lm_jsonl, write_lm_tokenizer, write_preference_jsonl
from tests.trainjobs.live import LiveService
from trainer_core.spec_preference import REWARD_METRICS

pytestmark = pytest.mark.slow

LORA = {"type": "lora", "r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}


@pytest.fixture(scope="module")
def http(service: LiveService) -> httpx.Client:
    made = service.cli("keys", "create", "--owner", "preference")
    assert made.returncode == 0, made.stderr
    return httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {made.stdout.strip()}"}, timeout=120)


@pytest.fixture(scope="module")
def lm_root(service: LiveService) -> Path:
    root = service.data_root / "preference"
    write_lm_tokenizer(root / "tok")
    write_lm_tokenizer(root / "plain-tok", chat_template=False)
    return root


def trained(http: httpx.Client, spec: dict[str, Any]) -> dict[str, Any]:
    created = http.post("/v1/jobs", json=spec)
    assert created.status_code == 201, created.text
    job = wait_finished(http, created.json()["id"], timeout=400)
    assert job["status"] == "succeeded", job["error"]
    return job


def test_sft_then_dpo_from_its_checkpoint_streams_rewards_and_the_adapter_loads_with_peft(
    service: LiveService, http: httpx.Client, lm_root: Path, tmp_path: Path
) -> None:
    from peft import PeftModel

    from trainer_core.adapters import build_base_model
    from trainer_core.spec import parse_spec

    tokenizer = lm_root / "tok"
    sft_files = write_lm_jsonl(lm_root / "sft", "prompt-completion")
    sft = trained(http, lm_spec(sft_files, tokenizer, name="sft", adapter=LORA,
                                training={"max_steps": 4, "per_device_train_batch_size": 4, "save_steps": 4,
                                          "learning_rate": 1e-2, "eval_strategy": "no"}))  # fmt: skip
    pairs = write_preference_jsonl(lm_root / "pairs", "chat")
    spec = lm_spec(pairs, tokenizer, name="dpo", method="dpo", adapter=LORA, preference={"beta": 0.1},
                   init_from={"job": sft["id"], "checkpoint": "last"},
                   training={"max_steps": 6, "per_device_train_batch_size": 4, "logging_steps": 1,
                             "learning_rate": 1e-2, "eval_strategy": "steps", "eval_steps": 3,
                             "save_steps": 1000})  # fmt: skip
    dpo = trained(http, spec)
    assert dpo["started_from"]["job"] == sft["id"]

    # Every step's metric point carries the reward metrics; every evaluation their eval_ forms.
    names = {item["name"] for item in http.get(f"/v1/jobs/{dpo['id']}/metrics?limit=5000").json()["items"]}
    assert {"loss", *REWARD_METRICS, *(f"eval_{m}" for m in REWARD_METRICS), "eval_loss"} <= names
    assert "eval_perplexity" not in names
    accuracies = http.get(f"/v1/jobs/{dpo['id']}/metrics", params={"name": "rewards/accuracies"}).json()["items"]
    assert [p["step"] for p in accuracies] == [1, 2, 3, 4, 5, 6]
    assert all(0.0 <= p["value"] <= 1.0 for p in accuracies)

    folder = tmp_path / "adapter"
    folder.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        got = http.get(f"/v1/jobs/{dpo['id']}/artifacts/{name}")
        assert got.status_code == 200, got.text
        (folder / name).write_bytes(got.content)
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == LORA["r"]
    trained_weights = load_file(str(folder / "adapter_model.safetensors"))
    parent = load_file(str(Path(service.home) / "artifacts" / sft["id"] / "adapter_model.safetensors"))
    assert trained_weights.keys() == parent.keys()
    assert any(not torch.allclose(trained_weights[k], parent[k]) for k in parent)  # DPO moved the SFT adapter

    job_spec = parse_spec(spec)
    model = PeftModel.from_pretrained(build_base_model(job_spec, []), str(folder)).eval()
    loaded = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    assert len(loaded) == len(trained_weights)
    with torch.no_grad():
        generated = model.generate(input_ids=torch.tensor([[2, 5, 9]]), max_new_tokens=3, do_sample=False)
    assert generated.shape == (1, 6)


def refusal(http: httpx.Client, spec: dict[str, Any]) -> tuple[str, str]:
    answer = http.post("/v1/jobs", json=spec)
    assert answer.status_code == 422, answer.text
    assert answer.headers["content-type"].startswith("application/problem+json")
    error = answer.json()["errors"][0]
    return error["field"], error["message"]


def test_every_preference_refusal_names_its_field_at_submit(http: httpx.Client, lm_root: Path) -> None:
    pairs = write_preference_jsonl(lm_root / "pairs-text", "text")
    chat = write_preference_jsonl(lm_root / "pairs-chat", "chat")
    tokenizer = lm_root / "tok"

    no_rejected = lm_spec(pairs, tokenizer, name="refused", method="dpo", dataset={
        "path": "json", "data_files": pairs, "rejected_column": "worse"})  # fmt: skip
    field, message = refusal(http, no_rejected)
    assert field == "dataset.rejected_column" and "'worse'" in message

    field, _ = refusal(http, lm_spec(chat, lm_root / "plain-tok", name="refused", method="orpo"))
    assert field == "model.tokenizer"

    classifier = lm_spec(pairs, tokenizer, name="refused", task="text-classification", method="dpo")
    field, _ = refusal(http, classifier)
    assert field == "method"

    # A full fine-tune whose frozen reference copy does not fit the budget: the answer says what would.
    def total_bytes(spec: dict[str, Any]) -> int:
        answer = http.post("/v1/estimates", json={"spec": spec})
        assert answer.status_code == 200, answer.text
        return int(answer.json()["estimate"]["total_bytes"])

    full = lm_spec(pairs, tokenizer, name="refused", method="dpo")
    precomputed = {**full, "preference": {"reference": "precomputed"}}
    with_copy, without = total_bytes(full), total_bytes(precomputed)
    assert with_copy > without
    budget = {"gpu_memory_gb": (with_copy + without) / 2 / 2**30}  # the budget's GB are GiB
    field, message = refusal(http, {**full, "resources": budget})
    assert field == "preference.reference" and "frozen copy" in message
    assert "precomputed" in http.post("/v1/jobs", json={**full, "resources": budget}).json()["detail"]
    fits = http.post("/v1/jobs?dry_run=true", json={**precomputed, "resources": budget})
    assert fits.status_code == 200, fits.text
