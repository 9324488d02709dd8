"""Causal-LM and adapter specs: estimated over HTTP, refused at submit until the engine trains them."""

from __future__ import annotations

from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from service_core.db.models import Job
from tests.api.conftest import Keys, make_spec
from trainer_core.memory import estimate_memory
from trainer_core.spec import JobSpec

LLM = make_spec(
    name="sft",
    task="causal-lm",
    model={"name_or_path": "meta-llama/Llama-3.2-1B"},
    dataset={"path": "json", "data_files": {"train": "chat/train.jsonl"}, "messages_column": "conversation"},
    adapter={"type": "qlora", "r": 16},
    efficiency={"mixed_precision": "bf16"},
)


def test_causal_lm_submit_is_refused_naming_task(client: TestClient, keys: Keys, session: Session) -> None:
    response = client.post("/v1/jobs", json={**LLM, "adapter": None}, headers=keys.auth(keys.alice))
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/problem+json"
    assert [e["field"] for e in response.json()["errors"]] == ["task"]
    assert "not available yet" in response.json()["errors"][0]["message"]
    assert session.execute(select(func.count()).select_from(Job)).scalar_one() == 0


def test_adapter_on_classification_submit_is_refused_naming_adapter(client: TestClient, keys: Keys) -> None:
    spec = make_spec(adapter={"type": "lora", "target_modules": ["query", "value"]})
    response = client.post("/v1/jobs", json=spec, headers=keys.auth(keys.alice))
    assert response.status_code == 422, response.text
    assert [e["field"] for e in response.json()["errors"]] == ["adapter"]


def test_causal_lm_qlora_is_estimated(client: TestClient, keys: Keys) -> None:
    response = client.post("/v1/estimates/memory", json={"spec": LLM}, headers=keys.auth(keys.alice))
    assert response.status_code == 200, response.text
    expected = estimate_memory(JobSpec.model_validate(LLM))
    body = response.json()["estimate"]
    assert body["total_bytes"] == expected.total_bytes
    assert body["trainable_parameters"] == expected.trainable_parameters < expected.parameters // 50
    assert "logits_fp32" in [p["name"] for p in body["parts"]]
