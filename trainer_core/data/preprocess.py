"""One entry point per step, whatever the modality: which processor, which encoder, which collator."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import AutoFeatureExtractor, AutoImageProcessor, AutoTokenizer, PreTrainedConfig

from trainer_core.data.audio import AudioCollator, AudioEncoder, load_feature_extractor
from trainer_core.data.causal_lm import LMCollator
from trainer_core.data.image import ImageCollator, ImageEncoder, load_image_processor
from trainer_core.data.loading import spec_error
from trainer_core.data.packing import PackedCollator
from trainer_core.data.preference import PreferenceCollator
from trainer_core.data.text import (
    TextCollator,
    TextEncoder,
    lm_tokenizer_source,
    load_tokenizer,
    tokenizer_source,
    train_tokenizer_for,
)
from trainer_core.modeling import config_from_dict
from trainer_core.spec import TEXT_TASKS, JobSpec

logger = logging.getLogger(__name__)

Collator = Callable[[list[dict[str, Any]]], dict[str, torch.Tensor]]

# How a processor saved with save_pretrained is loaded back, per task.
PROCESSOR_LOADERS: dict[str, Any] = {
    "text-classification": AutoTokenizer,
    "causal-lm": AutoTokenizer,
    "image-classification": AutoImageProcessor,
    "audio-classification": AutoFeatureExtractor,
}
# Tokenizers with a larger limit are "unlimited" placeholders (transformers uses a huge int).
_UNLIMITED_LENGTH = 1_000_000


def default_model_config(spec: JobSpec) -> PreTrainedConfig | None:
    """The config of a config-built model (None for pretrained ones, whose processors are saved)."""
    return config_from_dict(spec.model.config) if spec.model.config is not None else None


def trains_tokenizer(spec: JobSpec) -> bool:
    """True when the run trains its own tokenizer (config-built text model with none named)."""
    return spec.task == "text-classification" and tokenizer_source(spec) is None


def load_processor(
    spec: JobSpec,
    train_texts: Iterable[str] | None = None,
    *,
    model_config: PreTrainedConfig | None = None,
) -> Any:
    """The tokenizer, image processor or feature extractor for ``spec``'s task.

    A config-built text-classification model with no ``model.tokenizer`` gets a WordPiece tokenizer
    trained on ``train_texts``, sized by the config's ``vocab_size``. causal-lm needs a named tokenizer
    (its chat template and special tokens matter); it gets an eos and a padding token if it lacks them.
    """
    config = model_config if model_config is not None else default_model_config(spec)
    if spec.task == "causal-lm":
        lm_tokenizer_source(spec)
        return load_tokenizer(spec)
    if spec.task == "text-classification":
        if not trains_tokenizer(spec):
            return load_tokenizer(spec)
        if train_texts is None:
            raise ValueError("a config-built text model without model.tokenizer needs train_texts")
        assert config is not None
        return train_tokenizer_for(config, train_texts)
    if spec.task == "image-classification":
        return load_image_processor(spec, config)
    return load_feature_extractor(spec, config)


def load_saved_processor(task: str, path: Path) -> Any:
    """A processor stored with ``save_pretrained`` (the cache keeps one next to the data)."""
    return PROCESSOR_LOADERS[task].from_pretrained(str(path))


def effective_max_length(spec: JobSpec, tokenizer: Any) -> int:
    """``preprocessing.max_length``, capped at the tokenizer's limit so positions stay in range."""
    limit = int(getattr(tokenizer, "model_max_length", _UNLIMITED_LENGTH) or _UNLIMITED_LENGTH)
    wanted = spec.preprocessing.max_length
    if limit < _UNLIMITED_LENGTH and wanted > limit:
        logger.warning("preprocessing.max_length %d exceeds the tokenizer's limit %d; using %d", wanted, limit, limit)
        return limit
    return wanted


def make_encoder(spec: JobSpec, processor: Any, label_to_id: Mapping[Any, int]) -> Callable[..., dict]:
    """The batched ``map`` function that turns raw rows into model inputs, ``labels`` and ``length``."""
    ds = spec.dataset
    if spec.task == "text-classification":
        return TextEncoder(
            tokenizer=processor,
            text_column=ds.text_column,
            text_pair_column=ds.text_pair_column,
            label_column=ds.label_column,
            label_to_id=label_to_id,
            max_length=effective_max_length(spec, processor),
        )
    if spec.task == "image-classification":
        return ImageEncoder(processor, ds.image_column, ds.label_column, label_to_id)
    return AudioEncoder(processor, ds.audio_column, ds.label_column, label_to_id, spec.preprocessing.max_duration_s)


def make_collator(task: str, processor: Any, *, packing: bool = False, preference: bool = False) -> Collator:
    """Dynamic padding for text and audio; stacking for images; for packed causal-lm rows a
    :class:`PackedCollator` the backends bind to the model's attention implementation; for preference
    pairs (method dpo/orpo) a :class:`PreferenceCollator` (chosen rows, then rejected rows)."""
    if task == "causal-lm":
        pad = int(processor.pad_token_id)
        if preference:
            return PreferenceCollator(pad)
        return PackedCollator(pad) if packing else LMCollator(pad)
    if task == "text-classification":
        return TextCollator(processor)
    if task == "image-classification":
        return ImageCollator()
    return AudioCollator(processor)


def encode(dataset: Dataset, encoder: Callable[..., dict], batch_size: int = 256) -> Dataset:
    """Apply ``encoder`` to every row, keeping only its outputs (model inputs, labels, length).

    datasets' own map cache is bypassed: trainjobs' cache (keyed on file contents) is the one that
    decides whether preprocessing is skipped, so ``cache_hit`` means what it says.
    """
    return dataset.map(
        encoder,
        batched=True,
        batch_size=batch_size,
        remove_columns=dataset.column_names,
        load_from_cache_file=False,
        desc="Preprocessing",
    )


def set_model_format(task: str, dataset: Dataset) -> Dataset:
    """Rows as numpy arrays for image/audio (fast stacking); text stays as lists for the tokenizer's pad."""
    if task in TEXT_TASKS:
        return dataset
    return dataset.with_format("numpy")


def check_input_text(spec: JobSpec, texts: list[Any]) -> list[str]:
    """Training text for the tokenizer trainer; empty rows are an error naming the column."""
    if any(t is None for t in texts):
        raise spec_error("dataset.text_column", "some training rows have no text")
    return [t if isinstance(t, str) else str(t) for t in texts]
