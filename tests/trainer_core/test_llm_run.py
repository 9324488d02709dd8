"""causal-lm through ``train_job`` on real files: chat data, a tokenizer with a chat template, adapters;
and the preflight field errors an LM spec can get before it runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from tests.trainer_core.llm_data import CHAT_TEMPLATE, lm_spec, write_lm_jsonl, write_lm_tokenizer
from tests.trainer_core.runhelpers import done_event, logged_losses, run
from trainer_core.backends.common import MERGED_DIR
from trainer_core.preflight import PreflightError, preflight
from trainer_core.spec import parse_spec

TRAINING = {"max_steps": 4, "per_device_train_batch_size": 4, "logging_steps": 1, "learning_rate": 1e-2,
            "eval_strategy": "steps", "eval_steps": 4}  # fmt: skip


@pytest.mark.parametrize(
    ("backend", "adapter", "packing"),
    [
        ("trainer", {"type": "qlora", "r": 8, "compute_dtype": "fp32"}, True),
        ("accelerate", {"type": "lora", "r": 8, "merge": True}, True),
        ("accelerate", {"type": "lora", "r": 8}, False),
    ],
)
def test_chat_sft_with_an_adapter_writes_adapter_tokenizer_and_merge(
    tmp_path: Path, backend: str, adapter: dict[str, Any], packing: bool
) -> None:
    files, tokenizer = write_lm_jsonl(tmp_path / "data", "chat"), write_lm_tokenizer(tmp_path / "tok")
    spec = parse_spec(lm_spec(
        files, tokenizer, adapter=adapter, preprocessing={"max_length": 64, "packing": packing},
        training={**TRAINING, "backend": backend},
    ))  # fmt: skip
    out = tmp_path / "out"
    status, events = run(spec, out)
    assert status == "succeeded", done_event(events)
    losses = logged_losses(events)
    assert losses[-1] < losses[0], losses
    assert set(events.of_kind("eval")[-1]["values"]) == {"eval_loss", "eval_perplexity"}
    # Both backends bind the packed collator to the model (SDPA here: rows with a block-diagonal mask).
    assert [e["packing"] for e in events.of_kind("log") if "packing" in e] == (["rows"] if packing else [])
    assert (out / "adapter_model.safetensors").is_file() and (out / "adapter_config.json").is_file()
    assert not (out / "model.safetensors").exists()  # the adapter, not a copy of the base
    assert AutoTokenizer.from_pretrained(out).chat_template == CHAT_TEMPLATE
    assert (out / MERGED_DIR / "model.safetensors").is_file() == bool(adapter.get("merge"))


def test_preflight_names_target_modules_packing_and_chat_template(tmp_path: Path) -> None:
    files = write_lm_jsonl(tmp_path / "data", "chat")
    plain = write_lm_tokenizer(tmp_path / "plain", chat_template=False)
    doc = lm_spec(files, plain, adapter={"type": "lora", "target_modules": ["query"]}, preprocessing={"packing": True})
    doc["model"]["config"] = {**doc["model"]["config"], "model_type": "mamba", "vocab_size": 300}
    with pytest.raises(PreflightError) as info:
        preflight(parse_spec(doc))
    fields = [e.field for e in info.value.errors]
    assert fields == ["adapter.target_modules", "preprocessing.packing", "model.tokenizer"]
    assert "chat template" in info.value.errors[2].message
    good = preflight(parse_spec(lm_spec(files, write_lm_tokenizer(tmp_path / "chat"), adapter={"type": "qlora"})))
    assert {"adapter_targets", "lm_model", "chat_template"} <= set(good.checks)
