"""``preprocessing.packing``: several causal-lm examples per row, none attending to another.

Rows are filled best-fit decreasing (as TRL's ``pack_dataset(strategy="bfd")``; written here because
TRL is not a dependency): examples sorted longest first, each put in the row with the least room that
still holds it, else in a new row. On varied lengths this fills rows better than greedy packing in
data order (0.997 against 0.807 of the positions, tests/trainer_core/test_data_packing.py). Each
example keeps its own positions (``position_ids`` restart at 0), and the label of each example's first
token is -100, so no token is predicted from the example before it. An example longer than
``max_length`` (the encoders truncate, so none should be) gets a row of its own.

How a batch of packed rows reaches the model depends on its attention implementation
(:class:`PackedCollator`, bound to the model by the backends):

* **rows** (eager, SDPA): the batch stays ``[B, L]``, padded to its longest row, with a 4D
  block-diagonal causal mask ``[B, 1, L, L]`` that keeps each row's examples apart (transformers passes
  a 4D mask through untouched: ``masking_utils._preprocess_mask_arguments``). Attention costs
  ``B x L^2``, as padding does; the flattened batch cost ``(B x L)^2`` there, and trained a tiny Llama
  on the CPU 2.0x (SDPA) to 2.9x (eager) slower than these rows. The mask is boolean for SDPA and
  additive float for eager, as transformers' own ``sdpa_mask`` / ``eager_mask`` are (eager adds it
  to the scores).
* **flattened** (flash attention): one ``[1, B x L]`` sequence with ``position_ids`` and no attention
  mask, as 🤗 ``DataCollatorWithFlattening`` does; the varlen kernels read the example boundaries from
  where ``position_ids`` restart and attend within each example only. Flash attention takes no 4D
  mask and detects packed sequences only at batch size 1 (``_is_packed_sequence``), hence this shape.

A model whose attention does not go through transformers' mask builders would attend across examples,
so :func:`packing_error` refuses it. The model must run without a KV cache (``use_cache=False``):
transformers skips the packed-sequence detection the flattened path relies on when a cache is passed.
"""

from __future__ import annotations

import bisect
import inspect
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import datasets
import torch
from transformers import PreTrainedConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
from transformers.utils.generic import is_flash_attention_requested

from trainer_core.data.causal_lm import IGNORE_INDEX, LMCollator

# transformers' mask builders (masking_utils): they pass a custom 4D mask through and detect packed
# sequences from position_ids.
_PACKING_AWARE_MASKS = ("create_causal_mask", "create_sliding_window_causal_mask", "create_masks_for_generate")
# Attention implementations that take a 4D tensor mask; flash attention flattens instead.
_ROW_MASK_ATTENTION = ("eager", "sdpa")

PackingLayout = Literal["rows", "flattened"]
# Bumped when the way examples are packed into rows changes, so cached packed data is rebuilt.
PACKING_RECIPE = "best-fit-decreasing-v1"


def packing_error(model_config: PreTrainedConfig) -> str | None:
    """Why ``preprocessing.packing`` cannot be used with this model, or None when it can.

    Packing needs a causal-LM class whose forward takes ``position_ids`` and whose attention mask is
    built by transformers' ``masking_utils`` (which takes the packed rows' mask). Recurrent models
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
    try:  # an implementation the config names (None: the default, known once the model is built)
        packing_layout(getattr(model_config, "_attn_implementation", None))
    except ValueError as exc:
        return str(exc)
    return None


def packing_layout(attn_implementation: str | None) -> PackingLayout:
    """How packed rows reach a model with this attention implementation (None: not known yet, rows as
    under transformers' default SDPA); one that takes neither shape is refused rather than left to leak."""
    if is_flash_attention_requested(requested_attention_implementation=attn_implementation):
        return "flattened"
    if attn_implementation is None or attn_implementation in _ROW_MASK_ATTENTION:
        return "rows"
    raise ValueError(f"packing supports eager, sdpa and flash attention, not {attn_implementation!r}")


def best_fit_rows(lengths: Sequence[int], max_length: int) -> list[list[int]]:
    """Best-fit decreasing: the indices of the examples each row holds, rows in the order opened.

    ``room`` stays sorted by (space left, row), so the tightest row that fits is one bisection away.
    """
    rows: list[list[int]] = []
    room: list[tuple[int, int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):  # stable: ties keep data order
        length = lengths[index]
        slot = bisect.bisect_left(room, (length, -1))
        if slot < len(room):
            space, row = room.pop(slot)
            rows[row].append(index)
        else:
            space, row = max_length, len(rows)
            rows.append([index])
        if space > length:
            bisect.insort(room, (space - length, row))
    return rows


@dataclass(frozen=True)
class Packer:
    """Batched ``map`` function: packs the encoded examples of each map batch into rows of at most
    ``max_length`` (:func:`best_fit_rows`)."""

    max_length: int

    def __call__(self, batch: Mapping[str, list[Any]]) -> dict[str, list[Any]]:
        out: dict[str, list[Any]] = {"input_ids": [], "labels": [], "position_ids": [], "length": []}
        for members in best_fit_rows([len(ids) for ids in batch["input_ids"]], self.max_length):
            ids: list[int] = []
            labels: list[int] = []
            positions: list[int] = []
            for i in members:
                ids += batch["input_ids"][i]
                labels += [IGNORE_INDEX, *batch["labels"][i][1:]]
                positions += range(len(batch["input_ids"][i]))
            out["input_ids"].append(ids)
            out["labels"].append(labels)
            out["position_ids"].append(positions)
            out["length"].append(len(ids))
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
class PackedCollator:
    """Collates packed rows for a model's attention implementation (see the module docstring).

    ``attn_implementation`` is the model's ``config._attn_implementation``: data is prepared before the
    model exists, so the backends bind it with :meth:`for_model`; an unbound collator (None) refuses to
    run rather than guess a mask format.
    """

    pad_token_id: int
    attn_implementation: str | None = None

    def for_model(self, model_config: PreTrainedConfig) -> PackedCollator:
        """This collator for a model with ``model_config`` (its layout checked now, not mid-run)."""
        # transformers runs eager attention when the config names none.
        implementation = str(getattr(model_config, "_attn_implementation", None) or "eager")
        packing_layout(implementation)
        return PackedCollator(self.pad_token_id, implementation)

    @property
    def layout(self) -> PackingLayout:
        return packing_layout(self.attn_implementation)

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if self.attn_implementation is None:
            raise RuntimeError("a PackedCollator needs the model's attention implementation: call for_model first")
        if self.layout == "flattened":
            return _flattened(features)
        return _rows(features, self.pad_token_id, additive=self.attn_implementation == "eager")


def _flattened(features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """One ``[1, total_tokens]`` sequence and no ``attention_mask`` (its absence is what lets
    transformers read the boundaries from ``position_ids``)."""
    out = {}
    for key in ("input_ids", "labels", "position_ids"):
        flat = [int(v) for f in features for v in f[key]]
        out[key] = torch.tensor([flat], dtype=torch.long)
    return out


def _rows(features: list[dict[str, Any]], pad_token_id: int, *, additive: bool) -> dict[str, torch.Tensor]:
    """``[B, L]`` rows padded to the longest, with their block-diagonal causal 4D mask."""
    out = LMCollator(pad_token_id)(features)
    real = out.pop("attention_mask").bool()
    positions = torch.zeros_like(out["input_ids"])
    for i, f in enumerate(features):
        positions[i, : len(f["position_ids"])] = torch.as_tensor(f["position_ids"], dtype=torch.long)
    # Example k of a row is segment k (1-based); padding is segment 0, attending causally to itself
    # only, so no query row is fully masked (a row of -inf gives NaN under softmax).
    segments = torch.cumsum((positions == 0) & real, dim=1) * real
    width = segments.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    mask = (segments[:, :, None] == segments[:, None, :]) & causal
    mask = mask[:, None]  # [B, 1, L, L]: one mask for every head
    if additive:
        mask = torch.zeros(mask.shape).masked_fill(~mask, torch.finfo(torch.float32).min)
    return {**out, "position_ids": positions, "attention_mask": mask}
