"""Causal-LM and adapter specs over HTTP: estimated, and refused at submit naming the field when invalid."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from api.estimation import liger_errors
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


def test_target_modules_that_match_nothing_are_refused_at_submit(
    client: TestClient, keys: Keys, session: Session
) -> None:
    spec = make_spec(adapter={"type": "lora", "target_modules": ["q_proj", "v_proj"]})  # a BERT has query/value
    response = client.post("/v1/jobs", json=spec, headers=keys.auth(keys.alice))
    assert response.status_code == 422, response.text
    assert response.headers["content-type"] == "application/problem+json"
    (error,) = response.json()["errors"]
    assert error["field"] == "adapter.target_modules" and "query" in error["message"]
    assert session.execute(select(func.count()).select_from(Job)).scalar_one() == 0


def test_merging_a_qlora_adapter_is_refused_at_submit(client: TestClient, keys: Keys) -> None:
    spec = {**LLM, "adapter": {"type": "qlora", "merge": True}}
    response = client.post("/v1/jobs", json=spec, headers=keys.auth(keys.alice))
    assert response.status_code == 422, response.text
    assert [e["field"] for e in response.json()["errors"]] == ["adapter.merge"]


def test_causal_lm_qlora_is_estimated(client: TestClient, keys: Keys) -> None:
    response = client.post("/v1/estimates/memory", json={"spec": LLM}, headers=keys.auth(keys.alice))
    assert response.status_code == 200, response.text
    expected = estimate_memory(JobSpec.model_validate(LLM))
    body = response.json()["estimate"]
    assert body["total_bytes"] == expected.total_bytes
    assert body["trainable_parameters"] == expected.trainable_parameters < expected.parameters // 50
    assert "logits_fp32" in [p["name"] for p in body["parts"]]


def test_liger_is_refused_at_submit_where_no_worker_trains_on_cuda(
    client: TestClient, keys: Keys, session: Session, app: Any, settings: Any
) -> None:
    from service_core.db.base import utcnow
    from service_core.db.models import WorkerHeartbeat
    from trainer_core.spec import parse_spec

    spec = {**LLM, "efficiency": {"mixed_precision": "bf16", "liger": True}}
    response = client.post("/v1/jobs", json=spec, headers=keys.auth(keys.alice))
    assert response.status_code == 422, response.text
    (error,) = response.json()["errors"]
    assert error["field"] == "efficiency.liger" and "no worker of queue 'default' has a GPU" in error["message"]
    assert session.execute(select(func.count()).select_from(Job)).scalar_one() == 0

    parsed, sessions = parse_spec(spec), app.state.sessionmaker
    session.add(WorkerHeartbeat(name="cpu-box", queues=["default"], slots=1, device_memory_gb=16.0, device_kind="cpu",
                                heartbeat_at=utcnow()))  # fmt: skip
    session.add(WorkerHeartbeat(name="gpu-box", queues=["gpu"], slots=1, device_memory_gb=80.0, device_kind="gpu",
                                heartbeat_at=utcnow()))  # fmt: skip
    session.commit()
    assert [e.field for e in liger_errors(parsed, "default", settings, sessions)] == ["efficiency.liger"]
    assert liger_errors(parsed, "gpu", settings, sessions) == []  # a live GPU worker serves it
    named = settings.model_copy(update={"queue_devices": {"default": "H100-SXM", "cpu-q": "cpu"}})
    assert liger_errors(parsed, "default", named, sessions) == []  # the queue's device is a GPU
    (on_cpu,) = liger_errors(parsed, "cpu-q", named, sessions)
    assert "queue 'cpu-q' trains on the CPU" in on_cpu.message
    assert liger_errors(parse_spec(LLM), "default", settings, sessions) == []  # only when asked for


def test_a_sharded_spec_is_estimated_per_rank_and_a_multi_node_one_needs_as_many_workers(
    client: TestClient, keys: Keys, session: Session
) -> None:
    from service_core.db.base import utcnow
    from service_core.db.models import WorkerHeartbeat

    full = {**LLM, "adapter": None, "training": {"backend": "accelerate"}}
    sharded = {**full, "efficiency": {"mixed_precision": "bf16", "sharding": "fsdp"},
               "resources": {"num_processes": 4, "num_nodes": 2}}  # fmt: skip
    response = client.post("/v1/estimates/memory", json={"spec": sharded}, headers=keys.auth(keys.alice))
    assert response.status_code == 200, response.text
    body = response.json()["estimate"]
    assert body["devices"] == 8 and body["sharding"] == "fsdp"  # the world: nodes x processes
    assert body["total_bytes"] == estimate_memory(JobSpec.model_validate(sharded)).total_bytes
    assert "fsdp_gathered" in [p["name"] for p in body["parts"]] and body["ddp_bucket_bytes"] == 0
    # two nodes need two live workers of the queue: none, then one, is not enough
    response = client.post("/v1/jobs", json=sharded, headers=keys.auth(keys.alice))
    assert response.status_code == 422, response.text
    (error,) = response.json()["errors"]
    assert error["field"] == "resources.num_nodes" and "which has 0 live" in error["message"]
    two_nodes = make_spec(resources={"num_processes": 1, "num_nodes": 2})
    session.add(WorkerHeartbeat(name="box-a", queues=["default"], slots=1, heartbeat_at=utcnow()))
    session.commit()
    response = client.post("/v1/jobs", json=two_nodes, headers=keys.auth(keys.alice))
    assert response.status_code == 422, response.text
    (error,) = response.json()["errors"]
    assert error["field"] == "resources.num_nodes" and "which has 1 live" in error["message"]
    assert session.execute(select(func.count()).select_from(Job)).scalar_one() == 0
    session.add(WorkerHeartbeat(name="box-b", queues=["default"], slots=1, heartbeat_at=utcnow()))
    session.commit()
    response = client.post("/v1/jobs", json=two_nodes, headers=keys.auth(keys.alice))
    assert response.status_code == 201, response.text
    stored = session.execute(select(Job.nodes, Job.devices).where(Job.id == response.json()["id"])).one()
    assert tuple(stored) == (2, 2)
    # The planner spreads a full fine-tune that fits no device over as many machines as the queue has
    # workers: 1B parameters at 8 GiB a device, sharded over 4 nodes once there are 4.
    one_process = {**full, "efficiency": {"mixed_precision": "bf16"}}
    two_workers = client.post("/v1/estimates", json={"spec": one_process, "gpu_memory_gb": 8},
                              headers=keys.auth(keys.alice)).json()["plan"]  # fmt: skip
    assert all(entry["spec"]["resources"]["num_nodes"] == 1 for entry in two_workers["entries"])
    for name in ("box-c", "box-d"):
        session.add(WorkerHeartbeat(name=name, queues=["default"], slots=1, heartbeat_at=utcnow()))
    session.commit()
    four_workers = client.post("/v1/estimates", json={"spec": one_process, "gpu_memory_gb": 8},
                               headers=keys.auth(keys.alice)).json()["plan"]  # fmt: skip
    first = four_workers["entries"][0]
    assert first["changes"]["resources.num_nodes"] == 4 and first["changes"]["efficiency.sharding"] == "fsdp"
    assert "4 nodes of 1 process" in first["reason"]
    # a spec sharding can't run is refused at submit too, naming the field
    response = client.post("/v1/jobs", json={**sharded, "optimizer": {"name": "adamw_8bit"}},
                           headers=keys.auth(keys.alice))  # fmt: skip
    assert response.status_code == 422 and [e["field"] for e in response.json()["errors"]] == ["optimizer.name"]
