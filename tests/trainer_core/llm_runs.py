"""Causal-LM runs on hand-made token data, straight through a backend (no tokenizer, no data files).

The data is counting sequences (``s, s+1, s+2, ...`` mod the vocabulary), which a tiny model learns in
a few steps, padded to a common length with labels ``-100`` on the padding, as the causal-LM data
pipeline hands them over. The model side (adapters, both backends, resume, artifacts) is tested on it
without depending on that pipeline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets
import torch

from tests.trainer_core.memory.llm_models import LLM_CONFIGS
from trainer_core.backends import RunContext, run_backend
from trainer_core.backends.context import BackendResult
from trainer_core.data import PreparedData
from trainer_core.events import EventCollector
from trainer_core.run import _reset_accelerate_state
from trainer_core.spec import JobSpec, parse_spec
from trainer_core.stopping import StopSignal

VOCAB = 300
IGNORE = -100


def counting_rows(n: int, seed: int) -> dict[str, list[Any]]:
    """``n`` counting sequences of 6 to 12 tokens, with labels = inputs and their lengths."""
    gen = torch.Generator().manual_seed(seed)
    ids, lengths = [], []
    for _ in range(n):
        start = int(torch.randint(1, VOCAB, (1,), generator=gen))
        length = int(torch.randint(6, 13, (1,), generator=gen))
        ids.append([(start + i) % VOCAB for i in range(length)])
        lengths.append(length)
    return {"input_ids": ids, "labels": [list(x) for x in ids], "length": lengths}


def pad_collator(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Right padding with 0, attention mask 0 and label -100 on the padding."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        ids[i, :n] = torch.tensor(row["input_ids"])
        labels[i, :n] = torch.tensor(row["labels"])
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def counting_data(n_train: int = 32, n_eval: int = 8) -> PreparedData:
    return PreparedData(
        train=datasets.Dataset.from_dict(counting_rows(n_train, seed=0)),
        eval=datasets.Dataset.from_dict(counting_rows(n_eval, seed=1)) if n_eval else None,
        labels=[],
        collator=pad_collator,
        processor=None,
        cache_hit=False,
        cache_key="handmade",
    )


ADAPTERS: dict[str, dict[str, Any] | None] = {
    "full": None,
    "lora": {"type": "lora", "r": 8, "alpha": 16, "dropout": 0.0},
    "qlora": {"type": "qlora", "r": 8, "alpha": 16, "dropout": 0.0, "compute_dtype": "fp32"},
}


def llm_spec(arch: str, kind: str, backend: str, **sections: dict[str, Any]) -> JobSpec:
    """A causal-LM spec for the tiny ``arch`` with adapter ``kind``; ``sections`` are merged in."""
    doc: dict[str, Any] = {
        "name": f"{arch}-{kind}",
        "task": "causal-lm",
        "model": {"config": dict(LLM_CONFIGS[arch])},
        "dataset": {"path": "json"},
        "adapter": ADAPTERS[kind],
        "training": {
            "backend": backend, "max_steps": 8, "learning_rate": 1e-2, "per_device_train_batch_size": 8,
            "logging_steps": 1, "eval_strategy": "no", "save_steps": 1000,
        },
        "preprocessing": {"max_length": 16, "group_by_length": False},
    }  # fmt: skip
    for name, values in sections.items():
        doc[name] = {**doc.get(name, {}), **values}
    return parse_spec(doc)


def run_llm(
    spec: JobSpec, output_dir: Path, data: PreparedData | None = None, resume_from: Path | None = None
) -> tuple[BackendResult, EventCollector]:
    """Train ``spec`` on counting data (or ``data``) with its backend, in this process."""
    _reset_accelerate_state()
    events = EventCollector()
    output_dir.mkdir(parents=True, exist_ok=True)
    with StopSignal(None) as stop:
        ctx = RunContext(
            spec=spec, output_dir=output_dir, data=data or counting_data(), emit=events, stop=stop,
            resume_from=resume_from,
        )  # fmt: skip
        result = run_backend(ctx)
    return result, events


def losses(events: EventCollector) -> list[float]:
    return [float(e["values"]["loss"]) for e in events.of_kind("metric")]
