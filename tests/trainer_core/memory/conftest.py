"""Factories for the memory tests: tiny config-built models of each modality and specs naming them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from trainer_core.memory.catalog import catalog_entry, in_catalog
from trainer_core.spec import JobSpec, parse_spec

# hidden 64 so that the 64x128 MLP matrices (8192 elements) take bnb's 8-bit path (>= 4096).
TINY_CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "text": (
        "text-classification",
        {
            "model_type": "bert", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "intermediate_size": 128, "vocab_size": 300, "max_position_embeddings": 64, "num_labels": 3,
        },
    ),
    "image": (
        "image-classification",
        {
            "model_type": "vit", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "intermediate_size": 128, "image_size": 32, "patch_size": 8, "num_labels": 3,
        },
    ),
    "conv": (
        "image-classification",
        {"model_type": "convnext", "hidden_sizes": [16, 64], "depths": [1, 1], "num_stages": 2, "num_labels": 3},
    ),
    "audio": (
        "audio-classification",
        {
            "model_type": "wav2vec2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "intermediate_size": 128, "conv_dim": [32, 32], "conv_kernel": [10, 3], "conv_stride": [5, 2],
            "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 2, "classifier_proj_size": 16,
            "num_labels": 3,
        },
    ),
}  # fmt: skip


def spec_dict(task: str, model: dict[str, Any], **sections: dict[str, Any]) -> dict[str, Any]:
    """A minimal valid spec document; ``sections`` override whole sections (``training={...}``)."""
    data: dict[str, Any] = {"name": "memtest", "task": task, "model": model, "dataset": {"path": "csv"}}
    data.update(sections)
    return data


SpecFactory = Callable[..., JobSpec]


@pytest.fixture
def make_spec() -> SpecFactory:
    """``make_spec("text", optimizer={"name": "adafactor"})`` or ``make_spec("bert-base-uncased", ...)``."""

    def factory(model: str, task: str | None = None, **sections: dict[str, Any]) -> JobSpec:
        if model in TINY_CONFIGS:
            tiny_task, config = TINY_CONFIGS[model]
            return parse_spec(spec_dict(task or tiny_task, {"config": dict(config)}, **sections))
        if task is None:
            task = catalog_entry(model)["task"] if in_catalog(model) else "text-classification"
        return parse_spec(spec_dict(task, {"name_or_path": model}, **sections))

    return factory


def tiny_batch(kind: str, batch: int = 2) -> dict[str, torch.Tensor]:
    """Random inputs with labels for a tiny model of ``kind``."""
    gen = torch.Generator().manual_seed(0)
    labels = torch.arange(batch) % 3
    if kind == "text":
        return {"input_ids": torch.randint(0, 300, (batch, 12), generator=gen), "labels": labels}
    if kind in ("image", "conv"):
        return {"pixel_values": torch.randn(batch, 3, 32, 32, generator=gen), "labels": labels}
    return {"input_values": torch.randn(batch, 4000, generator=gen), "labels": labels}
