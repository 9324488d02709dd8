"""A QLoRA chat fine-tune through the whole service: submitted over HTTP, run by a real worker process,
its metrics streamed over SSE, its adapter downloaded and loaded with PEFT."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from tests.trainer_core.llm_data import lm_spec, write_lm_jsonl, write_lm_tokenizer

from .live import read_sse
from .test_service_e2e import started_service, wait_status

pytestmark = pytest.mark.slow
TRAINING = {"max_steps": 4, "per_device_train_batch_size": 4, "logging_steps": 1, "learning_rate": 1e-2,
            "eval_strategy": "steps", "eval_steps": 4, "save_steps": 1000}  # fmt: skip


def test_a_qlora_job_streams_metrics_and_its_adapter_loads(tmp_path: Path) -> None:
    from peft import PeftModel

    from trainer_core.adapters import build_base_model
    from trainer_core.spec import parse_spec

    with started_service("embedded", tmp_path) as service:
        root = service.settings.data_root / "lm"  # jobs read local paths under the data root only
        files, tokenizer = write_lm_jsonl(root / "data", "chat"), write_lm_tokenizer(root / "tok")
        spec = lm_spec(files, tokenizer, adapter={"type": "qlora", "r": 8, "compute_dtype": "fp32"}, training=TRAINING)
        with service.client(timeout=120) as client:  # a submit loads the tokenizer
            # A submit waits at most 10 s for the API's warm-up imports; a busy machine can take longer.
            deadline = time.monotonic() + 300
            while not client.get("/readyz").json().get("warmed_up") and time.monotonic() < deadline:
                time.sleep(0.5)
            created = client.post("/v1/jobs", json={**spec, "queue": service.queue})
            assert created.status_code == 201, created.text
            job_id = created.json()["id"]
            with client.stream("GET", f"/v1/jobs/{job_id}/events", timeout=600) as response:
                frames = read_sse(response)  # ends when the job does
            final = wait_status(client, job_id, {"succeeded", "failed", "cancelled"}, timeout=30)
            assert final["status"] == "succeeded", final["error"]
            assert [f["data"]["step"] for f in frames if f["event"] == "metric"] == [1, 2, 3, 4]
            (evaluation,) = [f["data"]["values"] for f in frames if f["event"] == "eval"]
            assert set(evaluation) == {"eval_loss", "eval_perplexity"}
            measured, estimate = final["memory"]["measured"], final["estimate"]
            assert measured["parameter_bytes"] == estimate["parameter_bytes"]  # the 4-bit base, to the byte
            assert measured["optimizer_state_bytes"] == estimate["optimizer_state_bytes"]
            listing = {item["path"] for item in client.get(f"/v1/jobs/{job_id}/artifacts").json()["items"]}
            assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= listing
            model_dir = tmp_path / "downloaded"
            model_dir.mkdir()
            for name in ("adapter_config.json", "adapter_model.safetensors"):
                got = client.get(f"/v1/jobs/{job_id}/artifacts/{name}")
                assert got.status_code == 200
                (model_dir / name).write_bytes(got.content)

    job_spec = parse_spec(spec)
    torch.manual_seed(job_spec.training.seed)
    model = PeftModel.from_pretrained(build_base_model(job_spec, []), str(model_dir)).eval()
    with torch.no_grad():
        generated = model.generate(input_ids=torch.tensor([[2, 5, 9]]), max_new_tokens=3, do_sample=False)
    assert generated.shape == (1, 6)
