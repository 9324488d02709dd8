"""The causal-lm half of :func:`~trainer_core.data.prepare.prepare_data`: checks against the model's
config, then encode, drop rows with nothing to learn, and pack (``preprocessing.packing``)."""

from __future__ import annotations

import logging

import datasets
from transformers import AutoConfig, PreTrainedConfig, PreTrainedTokenizerBase

from trainer_core.data.causal_lm import drop_untrainable, make_lm_encoder
from trainer_core.data.loading import lm_shape, spec_error
from trainer_core.data.packing import pack, packing_error
from trainer_core.data.preference import check_preference_tokenizer, make_preference_encoder, pair_is_trainable
from trainer_core.data.preprocess import effective_max_length, encode
from trainer_core.spec import JobSpec

logger = logging.getLogger(__name__)


def lm_model_config(spec: JobSpec, model_config: PreTrainedConfig | None) -> PreTrainedConfig | None:
    """The model's config: given, else a pretrained model's ``config.json`` (None if unreadable here:
    loading the model reports that, with its own reason)."""
    if model_config is not None or spec.model.name_or_path is None:
        return model_config
    try:
        config = AutoConfig.from_pretrained(spec.model.name_or_path, revision=spec.model.revision)
    except (OSError, ValueError) as exc:
        logger.info("cannot read the config of %s before loading it: %s", spec.model.name_or_path, exc)
        return None
    assert isinstance(config, PreTrainedConfig)
    return config


def _config_field(spec: JobSpec, name: str) -> str:
    return f"model.config.{name}" if spec.model.config is not None else "model.name_or_path"


def check_lm_model(spec: JobSpec, config: PreTrainedConfig | None) -> None:
    """Packing the model cannot separate, or rows longer than its positions: errors before any work."""
    if config is None:
        return
    if spec.preprocessing.packing and (problem := packing_error(config)) is not None:
        raise spec_error("preprocessing.packing", problem)
    positions = getattr(config, "max_position_embeddings", None)
    if isinstance(positions, int) and spec.preprocessing.max_length > positions:
        raise spec_error(
            "preprocessing.max_length",
            f"{spec.preprocessing.max_length} exceeds the model's {positions} positions "
            f"({_config_field(spec, 'max_position_embeddings')}); use at most {positions}",
        )


def check_vocabulary(spec: JobSpec, tokenizer: PreTrainedTokenizerBase, config: PreTrainedConfig | None) -> None:
    """Token ids beyond the embedding table would fail mid-run with an index error; say so now."""
    vocab_size = getattr(config, "vocab_size", None)
    if isinstance(vocab_size, int) and len(tokenizer) > vocab_size:
        field = "model.config.vocab_size" if spec.model.config is not None else "model.tokenizer"
        raise spec_error(field, f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {vocab_size}")


def encode_lm_splits(
    spec: JobSpec,
    tokenizer: PreTrainedTokenizerBase,
    train: datasets.Dataset,
    eval_split: datasets.Dataset | None,
) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """Tokenise and mask both splits (same shape required), drop rows without targets, then pack.
    Preference jobs (method dpo/orpo) get prompt/chosen/rejected pairs instead (never packed)."""
    if spec.is_preference:
        return _encode_preference_splits(spec, tokenizer, train, eval_split)
    shape = lm_shape(spec.dataset, train.column_names)
    if eval_split is not None and (eval_shape := lm_shape(spec.dataset, eval_split.column_names)) != shape:
        raise spec_error("dataset.eval_split", f"the eval split holds {eval_shape} data, train holds {shape}")
    max_length = effective_max_length(spec, tokenizer)
    encoder = make_lm_encoder(spec, tokenizer, shape, max_length)
    out: list[datasets.Dataset | None] = []
    for name, split in (("train", train), ("eval", eval_split)):
        if split is None:
            out.append(None)
            continue
        ready = drop_untrainable(encode(split, encoder), name, max_length)
        out.append(pack(ready, max_length) if spec.preprocessing.packing else ready)
    train_ready = out[0]
    assert train_ready is not None
    return train_ready, out[1]


def _encode_preference_splits(
    spec: JobSpec,
    tokenizer: PreTrainedTokenizerBase,
    train: datasets.Dataset,
    eval_split: datasets.Dataset | None,
) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """Both splits as chosen/rejected sequence pairs (trainer_core/data/preference.py), rows whose
    truncation leaves an answer nothing to predict dropped."""
    max_length = effective_max_length(spec, tokenizer)
    for split in (train, eval_split):
        if split is not None:  # a sample of prompts tells chat rows (which need a chat template) from text
            check_preference_tokenizer(tokenizer, spec, split[:1000][spec.dataset.prompt_column])
    encoder = make_preference_encoder(spec, tokenizer, max_length)
    train_ready = drop_untrainable(encode(train, encoder), "train", max_length, keep=pair_is_trainable)
    if eval_split is None:
        return train_ready, None
    return train_ready, drop_untrainable(encode(eval_split, encoder), "eval", max_length, keep=pair_is_trainable)
