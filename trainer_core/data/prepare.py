"""``prepare_data``: from a spec to model-ready datasets, a collator and the processor, cached on disk."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch
from transformers import PreTrainedConfig

from trainer_core.data.cache import cache_key, load_entry, processor_fingerprint, save_entry
from trainer_core.data.lm_prepare import check_lm_model, check_vocabulary, encode_lm_splits, lm_model_config
from trainer_core.data.loading import build_label_mapping, check_columns, load_raw, select_splits
from trainer_core.data.preprocess import (
    check_input_text,
    default_model_config,
    encode,
    load_processor,
    load_saved_processor,
    make_collator,
    make_encoder,
    set_model_format,
    trains_tokenizer,
)
from trainer_core.data.text import tokenizer_source, trained_tokenizer_settings
from trainer_core.spec import TEXT_TASKS, JobSpec

logger = logging.getLogger(__name__)


@dataclass
class PreparedData:
    """Model-ready data for one run.

    ``train`` and ``eval`` hold only model inputs (``input_ids``/``attention_mask``/...,
    ``pixel_values``, ``input_values``/``input_features``), ``labels`` (int) and ``length`` (int, for
    length-grouped batching; the collator drops it).

    For ``method: dpo`` / ``orpo`` the rows hold ``chosen_input_ids``, ``chosen_labels``,
    ``rejected_input_ids``, ``rejected_labels`` and ``length`` (the longer sequence), and the collator
    is a :class:`~trainer_core.data.preference.PreferenceCollator` (2B rows: chosen, then rejected).

    Otherwise, for ``task: causal-lm`` the rows hold ``input_ids``, ``labels`` (a list as long as ``input_ids``,
    -100 on tokens the loss skips) and ``length``; packed rows (``preprocessing.packing``) also hold
    ``position_ids`` restarting at 0 per example. The collator returns ``input_ids``, ``labels`` and
    ``attention_mask`` padded to the batch's longest row (pad id, -100, 0); packed, it is a
    :class:`~trainer_core.data.packing.PackedCollator` that the backends bind to the model
    (``for_model``): padded rows with ``position_ids`` and a 4D block-diagonal mask, or under flash
    attention one flattened ``[1, total_tokens]`` sequence without a mask. ``labels`` (the class
    names) is then empty: there are no classes. ``processor`` is the tokenizer, with an eos and a
    padding token set (pad = eos when it had none) and its chat template.
    """

    train: datasets.Dataset
    eval: datasets.Dataset | None
    labels: list[str]
    collator: Callable[[list[dict]], dict[str, torch.Tensor]]
    processor: Any
    cache_hit: bool
    cache_key: str


def processor_identity(spec: JobSpec, model_config: PreTrainedConfig | None) -> dict[str, Any]:
    """What identifies the processor in the cache key, computed without preprocessing anything."""
    if trains_tokenizer(spec):
        assert model_config is not None
        return {"trained_tokenizer": trained_tokenizer_settings(model_config)}
    if spec.task in TEXT_TASKS:
        source = tokenizer_source(spec)
        return processor_fingerprint(source, spec.model.revision if spec.model.tokenizer is None else None)
    source = spec.model.processor or spec.model.name_or_path
    if source is not None:
        return processor_fingerprint(source, spec.model.revision if spec.model.processor is None else None)
    # A default processor is defined by its settings (size, sampling rate, normalisation).
    return {"default": load_processor(spec, model_config=model_config).to_json_string()}


def _tokenizer_training_text(spec: JobSpec, train: datasets.Dataset) -> list[str]:
    texts = check_input_text(spec, train[spec.dataset.text_column])
    if spec.dataset.text_pair_column is not None:
        texts += check_input_text(spec, train[spec.dataset.text_pair_column])
    return texts


def prepare_data(
    spec: JobSpec, cache_dir: Path | None, *, model_config: PreTrainedConfig | None = None
) -> PreparedData:
    """Load, split, label, preprocess and cache the spec's dataset.

    With ``cache_dir`` set, a run on the same inputs loads the preprocessed data (and the processor,
    a trained tokenizer included) from ``cache_dir/<key>`` instead of preprocessing again.
    ``model_config`` is only needed for config-built models (defaults to the spec's config).
    """
    config = model_config if model_config is not None else default_model_config(spec)
    if spec.task == "causal-lm":
        config = lm_model_config(spec, config)
        check_lm_model(spec, config)
    key = cache_key(spec, processor_identity(spec, config))
    if cache_dir is not None:
        entry = load_entry(Path(cache_dir), key)
        if entry is not None:
            logger.info("preprocessing cache hit: %s", Path(cache_dir) / key)
            processor = load_saved_processor(spec.task, entry.processor_dir)
            if spec.task == "causal-lm":  # the model's config is not part of the key
                check_vocabulary(spec, processor, config)
            return _prepared(spec, entry.train, entry.eval, entry.labels, processor, cache_hit=True, key=key)

    train, eval_split = select_splits(spec, load_raw(spec))
    check_columns(spec, train, "train")
    if eval_split is not None:
        check_columns(spec, eval_split, "eval")
    if spec.task == "causal-lm":
        names: list[str] = []
        processor = load_processor(spec, model_config=config)
        check_vocabulary(spec, processor, config)
        train_ready, eval_ready = encode_lm_splits(spec, processor, train, eval_split)
    else:
        mapping = build_label_mapping(train, eval_split, spec.dataset.label_column)
        names = mapping.names
        texts = _tokenizer_training_text(spec, train) if trains_tokenizer(spec) else None
        processor = load_processor(spec, texts, model_config=config)
        encoder = make_encoder(spec, processor, mapping.to_id)
        train_ready = encode(train, encoder)
        eval_ready = encode(eval_split, encoder) if eval_split is not None else None

    if cache_dir is not None:
        save_entry(Path(cache_dir), key, train_ready, eval_ready, names, processor)
        # Serve the saved copy, so a first run and a cache hit read exactly the same data.
        entry = load_entry(Path(cache_dir), key)
        if entry is not None:
            train_ready, eval_ready = entry.train, entry.eval
    return _prepared(spec, train_ready, eval_ready, names, processor, cache_hit=False, key=key)


def _prepared(
    spec: JobSpec,
    train: datasets.Dataset,
    eval_split: datasets.Dataset | None,
    labels: list[str],
    processor: Any,
    *,
    cache_hit: bool,
    key: str,
) -> PreparedData:
    return PreparedData(
        train=set_model_format(spec.task, train),
        eval=set_model_format(spec.task, eval_split) if eval_split is not None else None,
        labels=labels,
        collator=make_collator(spec.task, processor, packing=spec.preprocessing.packing, preference=spec.is_preference),
        processor=processor,
        cache_hit=cache_hit,
        cache_key=key,
    )
