"""``preprocessing.packing``: several causal-lm examples per row, none attending to another.

Rows are filled greedily in data order up to ``max_length`` tokens. Each example keeps its own
positions (``position_ids`` restart at 0), and the label of each example's first token is -100, so no
token is predicted from the example before it. The collator flattens a batch into one sequence of
shape ``[1, total_tokens]`` with no attention mask, as 🤗 ``DataCollatorWithFlattening`` does:
transformers then finds the example boundaries from where ``position_ids`` restart
(``masking_utils.find_packed_sequence_indices``: a block-diagonal causal mask for eager and sdpa;
flash attention reads the same boundaries from ``position_ids``). A model whose attention does not
take that route would attend across examples, so :func:`packing_error` refuses it.

Why one flattened sequence rather than a ``[batch, max_length]`` batch of packed rows: flash attention
detects packed sequences only at batch size 1 (``_is_packed_sequence``), so rows kept apart would let
it attend across examples. The price under eager/sdpa is a block-diagonal mask over the whole flattened
batch: attention work grows with ``(batch x max_length)^2`` instead of ``batch x max_length^2``.

The model must run without a KV cache (``use_cache=False``): transformers skips the packed-sequence
detection when a cache is passed, and models create one whenever ``config.use_cache`` is true, in
training mode too. Trainer sets ``config.use_cache = TrainingArguments.use_cache`` (False); a custom
loop must set ``model.config.use_cache = False`` itself.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import datasets
import torch
from transformers import PreTrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from trainer_core.data.causal_lm import IGNORE_INDEX

# transformers' mask builders that detect packed sequences from position_ids (masking_utils).
_PACKING_AWARE_MASKS = ("create_causal_mask", "create_sliding_window_causal_mask", "create_masks_for_generate")


def packing_error(model_config: PreTrainedConfig) -> str | None:
    """Why ``preprocessing.packing`` cannot be used with this model, or None when it can.

    Packing needs a causal-LM class whose forward takes ``position_ids`` and whose attention mask is
    built by transformers' ``masking_utils`` (which separates packed examples). Recurrent models
    (Mamba, RWKV) and models with their own masking would carry state or attention across examples.
    """
    model_type = getattr(model_config, "model_type", "?")
    try:
        model_class: Any = MODEL_FOR_CAUSAL_LM_MAPPING[type(model_config)]
    except KeyError:
        return f"model type {model_type!r} has no causal-LM class in transformers"
    if "position_ids" not in inspect.signature(model_class.forward).parameters:
        return f"{model_class.__name__} does not take position_ids, so packed examples cannot keep their own positions"
    module = sys.modules[model_class.__module__]
    if not any(hasattr(module, name) for name in _PACKING_AWARE_MASKS):
        return (
            f"{model_class.__name__} builds its attention mask without transformers' masking_utils, so packed "
            "examples would attend to each other"
        )
    return None


@dataclass(frozen=True)
class Packer:
    """Batched ``map`` function: concatenates encoded examples into rows of at most ``max_length``."""

    max_length: int

    def __call__(self, batch: Mapping[str, list[Any]]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {"input_ids": [], "labels": [], "position_ids": [], "length": []}
        row: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": []}

        def close() -> None:
            if row["input_ids"]:
                for key, values in row.items():
                    out[key].append(values)
                out["length"].append(len(row["input_ids"]))
            row.update({"input_ids": [], "labels": [], "position_ids": []})

        for ids, labels in zip(batch["input_ids"], batch["labels"], strict=True):
            if len(row["input_ids"]) + len(ids) > self.max_length:
                close()
            row["input_ids"] += ids
            row["labels"] += [IGNORE_INDEX, *labels[1:]]
            row["position_ids"] += range(len(ids))
        close()
        return out


def pack(dataset: datasets.Dataset, max_length: int, batch_size: int = 1000) -> datasets.Dataset:
    """``dataset`` (``input_ids``, ``labels``, ``length``) packed into rows of at most ``max_length``."""
    return dataset.map(
        Packer(max_length),
        batched=True,
        batch_size=batch_size,
        remove_columns=dataset.column_names,
        load_from_cache_file=False,
        desc="Packing",
    )


@dataclass(frozen=True)
class FlatteningCollator:
    """Concatenates a batch of packed rows into one ``[1, total_tokens]`` sequence with ``position_ids``
    and no ``attention_mask`` (its absence is what lets transformers read boundaries from positions)."""

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        out = {}
        for key in ("input_ids", "labels", "position_ids"):
            flat = [int(v) for f in features for v in f[key]]
            out[key] = torch.tensor([flat], dtype=torch.long)
        return out
