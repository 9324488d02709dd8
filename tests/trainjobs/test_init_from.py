"""``init_from`` over HTTP on the live service (SQLite, local artifacts root): a job continues from
another job's checkpoint, full and LoRA; the two are linked; every refusal is a 422 naming the field.

Each child trains one step at a learning rate of 1e-9, so its final weights are the checkpoint's it
started from: a child that started anywhere else (its own seeded random init, which is also where the
parent started) ends visibly apart. The fleet shape (PostgreSQL, the object store, another host) is
tests/fleet/test_init_from.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from safetensors.torch import load_file

from tests.conftest import wait_finished
from tests.trainjobs.conftest import job_spec
from tests.trainjobs.live import LiveService

pytestmark = pytest.mark.slow

LORA = {"type": "lora", "r": 8, "alpha": 16, "dropout": 0.0, "target_modules": ["query", "value"]}
STILL = {"max_steps": 1, "learning_rate": 1e-9, "eval_strategy": "no", "save_steps": 1000}


def owner_client(service: LiveService, owner: str) -> httpx.Client:
    made = service.cli("keys", "create", "--owner", owner)
    assert made.returncode == 0, made.stderr
    return httpx.Client(base_url=service.url, headers={"Authorization": f"Bearer {made.stdout.strip()}"}, timeout=60)


@pytest.fixture(scope="module")
def alice(service: LiveService) -> httpx.Client:
    return owner_client(service, "init-alice")


def submit(http: httpx.Client, spec: dict[str, Any]) -> httpx.Response:
    return http.post("/v1/jobs", json=spec)


def trained(http: httpx.Client, spec: dict[str, Any]) -> dict[str, Any]:
    created = submit(http, spec)
    assert created.status_code == 201, created.text
    job = wait_finished(http, created.json()["id"])
    assert job["status"] == "succeeded", job["error"]
    return job


@pytest.fixture(scope="module")
def full_parent(alice: httpx.Client, sentiment_files: dict[str, str]) -> str:
    """A full fine-tune saving at steps 2 and 4."""
    training = {"max_steps": 4, "save_steps": 2, "eval_strategy": "no", "num_train_epochs": 1}
    return str(trained(alice, job_spec(sentiment_files, "init-parent", training=training))["id"])


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], atol=1e-6), name


def test_a_full_fine_tune_continues_from_the_last_checkpoint_and_the_two_are_linked(
    service: LiveService, alice: httpx.Client, sentiment_files: dict[str, str], full_parent: str
) -> None:
    spec = job_spec(sentiment_files, "init-child", training=STILL, init_from={"job": full_parent, "checkpoint": "last"})
    child = trained(alice, spec)
    assert child["spec"]["init_from"] == {"job": full_parent, "checkpoint": 4}  # `last`, pinned at submit
    assert child["started_from"] == {"job": full_parent, "checkpoint": 4, "url": f"/v1/jobs/{full_parent}"}
    assert alice.get(f"/v1/jobs/{full_parent}").json()["continued_by"] == [child["id"]]
    artifacts = Path(service.home) / "artifacts"
    started = load_file(str(artifacts / full_parent / "checkpoint-4" / "model.safetensors"))
    assert_same(load_file(str(artifacts / child["id"] / "model.safetensors")), started)
    first = load_file(str(artifacts / full_parent / "checkpoint-2" / "model.safetensors"))
    assert any(not torch.allclose(first[name], started[name], atol=1e-6) for name in started)  # 4 is not 2


@pytest.fixture(scope="module")
def lora_parent(alice: httpx.Client, sentiment_files: dict[str, str]) -> str:
    """A LoRA job saving and evaluating at steps 2, 4 and 6."""
    training = {"max_steps": 6, "save_steps": 2, "eval_strategy": "steps", "eval_steps": 2, "num_train_epochs": 1}
    return str(trained(alice, job_spec(sentiment_files, "init-lora", training=training, adapter=LORA))["id"])


def test_a_lora_job_continues_from_the_best_checkpoint(
    service: LiveService, alice: httpx.Client, sentiment_files: dict[str, str], lora_parent: str
) -> None:
    parent = lora_parent
    (best,) = [item["step"] for item in alice.get(f"/v1/jobs/{parent}/checkpoints").json()["items"] if item["is_best"]]
    spec = job_spec(sentiment_files, "init-lora-child", training=STILL, adapter=LORA,
                    init_from={"job": parent, "checkpoint": "best"})  # fmt: skip
    child = trained(alice, spec)
    assert child["started_from"]["checkpoint"] == best
    artifacts = Path(service.home) / "artifacts"
    started = load_file(str(artifacts / parent / f"checkpoint-{best}" / "adapter_model.safetensors"))
    assert_same(load_file(str(artifacts / child["id"] / "adapter_model.safetensors")), started)


def refusal(http: httpx.Client, spec: dict[str, Any]) -> tuple[str, str]:
    answer = submit(http, spec)
    assert answer.status_code == 422, answer.text
    assert answer.headers["content-type"].startswith("application/problem+json")
    (error,) = answer.json()["errors"]
    return error["field"], error["message"]


def test_every_refusal_names_init_from(
    service: LiveService, alice: httpx.Client, sentiment_files: dict[str, str], full_parent: str, lora_parent: str
) -> None:
    def child(**init: Any) -> dict[str, Any]:
        return job_spec(sentiment_files, "refused", training=STILL, init_from={"job": full_parent, **init})

    stranger = owner_client(service, "init-stranger")
    field, theirs = refusal(stranger, child())
    assert field == "init_from.job"
    _, nobody = refusal(alice, {**child(), "init_from": {"job": "0" * 32}})
    assert theirs == nobody.replace("0" * 32, full_parent)  # another owner's job reads as no job at all

    assert refusal(alice, child(checkpoint=3)) == (
        "init_from.checkpoint", f"job {full_parent} has no complete checkpoint at step 3; it has: 2, 4"
    )  # fmt: skip
    config = {"model_type": "bert", "vocab_size": 1000, "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 2, "intermediate_size": 37}  # fmt: skip
    wider = {**child(), "model": {"config": config}}
    field, message = refusal(alice, wider)
    assert field == "init_from.job" and "model differs" in message
    field, message = refusal(alice, child(path="/tmp"))
    assert field == "init_from.path"
    other_optimizer = {**child(resume_optimizer=True), "optimizer": {"name": "adafactor"}}
    field, message = refusal(alice, other_optimizer)
    assert field == "init_from.resume_optimizer" and "'adamw'" in message

    lora = job_spec(sentiment_files, "init-lora-queued", adapter=LORA, training={"save_steps": 2})
    queued = submit(alice, {**lora, "queue": "init-nobody-serves-this"})
    assert queued.status_code == 201, queued.text
    waiting = queued.json()["id"]
    field, message = refusal(alice, {**child(checkpoint="last"), "init_from": {"job": waiting}})
    assert field == "init_from.checkpoint" and "is queued" in message
    field, message = refusal(alice, {**child(checkpoint=2), "init_from": {"job": waiting, "checkpoint": 2}})
    assert field == "init_from.checkpoint" and "has no complete checkpoint" in message
    assert alice.post(f"/v1/jobs/{waiting}/cancel").status_code == 202

    narrower = job_spec(sentiment_files, "refused", training=STILL, adapter={**LORA, "r": 4},
                        init_from={"job": lora_parent, "checkpoint": 2})  # fmt: skip
    field, message = refusal(alice, narrower)
    assert field == "init_from.job" and "rank 8; adapter.r is 4" in message
    field, message = refusal(alice, {**narrower, "adapter": None})
    assert field == "init_from.job" and "holds a LoRA adapter" in message


def test_an_estimate_of_a_spec_with_init_from_is_like_any_other(
    alice: httpx.Client, sentiment_files: dict[str, str], full_parent: str
) -> None:
    spec = job_spec(sentiment_files, "estimated", training=STILL)
    plain = alice.post("/v1/estimates", json={"spec": spec})
    assert plain.status_code == 200, plain.text
    continued = alice.post("/v1/estimates", json={"spec": {**spec, "init_from": {"job": full_parent}}})
    assert continued.status_code == 200, continued.text
    assert continued.json()["estimate"]["total_bytes"] == plain.json()["estimate"]["total_bytes"] > 0
