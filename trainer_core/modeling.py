"""Which model class a task trains, and the config it starts from.

Training and the memory estimator both call :func:`build_model`, so the estimator counts the same
architecture, head included, that a run trains.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForAudioClassification,
    AutoModelForCausalLM,
    AutoModelForImageClassification,
    AutoModelForSequenceClassification,
    PretrainedConfig,
)

from trainer_core.spec import ModelSpec, Task

MODEL_CLASSES: dict[str, Any] = {
    "text-classification": AutoModelForSequenceClassification,
    "image-classification": AutoModelForImageClassification,
    "audio-classification": AutoModelForAudioClassification,
    "causal-lm": AutoModelForCausalLM,
}

# Master weights stay fp32 whatever dtype a checkpoint or config names: mixed precision is autocast's
# job (fp32 weights and gradients), and the memory estimator counts parameters at this dtype.
MASTER_DTYPE = torch.float32


def config_from_dict(config: dict[str, Any]) -> PretrainedConfig:
    """A transformers config from a plain dict that names its ``model_type``."""
    values = dict(config)
    model_type = values.pop("model_type")
    return AutoConfig.for_model(model_type, **values)


def label_config(labels: list[str]) -> dict[str, Any]:
    """``num_labels``, ``id2label`` and ``label2id``, stored in the model config."""
    return {
        "num_labels": len(labels),
        "id2label": dict(enumerate(labels)),
        "label2id": {label: i for i, label in enumerate(labels)},
    }


def resolve_config(model: ModelSpec, labels: list[str], task: Task | None = None) -> PretrainedConfig:
    """The config a run starts from, with the label mapping set (a language model has none)."""
    if model.config is not None:
        config = config_from_dict(model.config)
    else:
        assert model.name_or_path is not None  # guaranteed by ModelSpec's validator
        config = AutoConfig.from_pretrained(model.name_or_path, revision=model.revision)
    if task == "causal-lm":  # its "labels" are its vocabulary
        return config
    for key, value in label_config(labels).items():
        setattr(config, key, value)
    return config


def build_model(task: Task, model: ModelSpec, labels: list[str], weights: str | None = None) -> nn.Module:
    """Instantiate the model for ``task``: pretrained weights when named, random init from a config.

    A pretrained checkpoint's own head is replaced when the label count differs
    (``ignore_mismatched_sizes``), as fine-tuning a classifier on new labels needs. ``labels`` is
    ignored for ``causal-lm``. Adapters are put on by :mod:`trainer_core.adapters`. ``weights``: a
    checkpoint folder to load instead (``init_from``, trainer_core/init_from.py), with this run's config.
    """
    cls = MODEL_CLASSES[task]
    config = resolve_config(model, labels, task)
    if weights is None and model.config is not None:
        return cls.from_config(config, dtype=MASTER_DTYPE)
    return cls.from_pretrained(
        weights or model.name_or_path,
        config=config,
        revision=None if weights else model.revision,
        ignore_mismatched_sizes=True,
        dtype=MASTER_DTYPE,
    )
