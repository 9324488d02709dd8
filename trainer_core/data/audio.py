"""Audio inputs: decode with soundfile, resample to the feature extractor's rate, cut, extract features.

datasets' own Audio decoding needs torchcodec, which this stack does not use; the audio column is read
as a file path or ``{bytes, path}`` and decoded here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import soundfile
import torch
from transformers import AutoFeatureExtractor, PreTrainedConfig
from transformers.models.auto.feature_extraction_auto import (
    FEATURE_EXTRACTOR_MAPPING_NAMES,
    feature_extractor_class_from_name,
)

from trainer_core.data.loading import file_source, spec_error
from trainer_core.spec import JobSpec


def load_feature_extractor(spec: JobSpec, model_config: PreTrainedConfig | None) -> Any:
    """``model.processor``, else the pretrained model's own, else a default for the config's model type.

    ``preprocessing.sampling_rate`` sets a default extractor's rate; a pretrained extractor's rate is
    part of the model and cannot be changed.
    """
    source = spec.model.processor or spec.model.name_or_path
    wanted_rate = spec.preprocessing.sampling_rate
    if source is not None:
        revision = spec.model.revision if spec.model.processor is None else None
        extractor = AutoFeatureExtractor.from_pretrained(source, revision=revision)
        if wanted_rate is not None and wanted_rate != extractor.sampling_rate:
            raise spec_error(
                "preprocessing.sampling_rate",
                f"the model's feature extractor works at {extractor.sampling_rate} Hz, not {wanted_rate} Hz; "
                "leave sampling_rate unset and audio is resampled to the model's rate",
            )
        return extractor
    assert model_config is not None, "config-built models pass their config"
    return default_feature_extractor(model_config, wanted_rate)


def default_feature_extractor(model_config: PreTrainedConfig, sampling_rate: int | None) -> Any:
    """The model type's feature extractor with default settings."""
    model_type = model_config.model_type
    class_name = FEATURE_EXTRACTOR_MAPPING_NAMES.get(model_type)
    cls = feature_extractor_class_from_name(class_name) if class_name else None
    if cls is None:
        raise spec_error(
            "model.processor",
            f"no default feature extractor for model_type {model_type!r}; name one in model.processor",
        )
    kwargs: dict[str, Any] = {}
    if sampling_rate is not None:
        kwargs["sampling_rate"] = sampling_rate
    norm = getattr(model_config, "feat_extract_norm", None)
    if norm is not None:
        # wav2vec2-style models with layer norm expect an attention mask; group-norm ones must not get one.
        kwargs["return_attention_mask"] = norm == "layer"
    return cls(**kwargs)


def read_audio(value: Any) -> tuple[np.ndarray, int]:
    """Mono float32 samples and their rate, from a path or ``{bytes, path}``."""
    source = file_source(value, "dataset.audio_column")
    samples, rate = soundfile.read(source, dtype="float32", always_2d=True)
    return samples.mean(axis=1), int(rate)


def resample(samples: np.ndarray, orig_rate: int, target_rate: int) -> np.ndarray:
    """Linear-interpolation resampling; when downsampling, a moving average first limits aliasing."""
    if orig_rate == target_rate or samples.size == 0:
        return samples.astype(np.float32, copy=False)
    if target_rate < orig_rate:
        # An odd width keeps the filter centred; an even one would shift the signal by half a sample.
        width = math.ceil(orig_rate / target_rate) | 1
        samples = np.convolve(samples, np.full(width, 1.0 / width, dtype=np.float32), mode="same")
    n_out = max(1, round(samples.size * target_rate / orig_rate))
    positions = np.arange(n_out, dtype=np.float64) * (orig_rate / target_rate)
    return np.interp(positions, np.arange(samples.size), samples).astype(np.float32)


def load_clip(value: Any, target_rate: int, max_duration_s: float) -> np.ndarray:
    """Decode, cut to ``max_duration_s`` and resample one clip."""
    samples, rate = read_audio(value)
    # Cut before resampling (one extra sample for interpolation) so long files cost little.
    samples = samples[: math.ceil(max_duration_s * rate) + 1]
    return resample(samples, rate, target_rate)[: int(max_duration_s * target_rate)]


@dataclass(frozen=True)
class AudioEncoder:
    """Turns a batch of rows into the extractor's first model input (unpadded)."""

    extractor: Any
    audio_column: str
    label_column: str
    label_to_id: Mapping[Any, int]
    max_duration_s: float

    def __call__(self, batch: Mapping[str, list[Any]]) -> dict[str, list[Any]]:
        rate = int(self.extractor.sampling_rate)
        clips = [load_clip(v, rate, self.max_duration_s) for v in batch[self.audio_column]]
        input_name = self.extractor.model_input_names[0]
        features = self.extractor(clips, sampling_rate=rate)[input_name]
        values = [np.asarray(f, dtype=np.float32) for f in features]
        return {
            input_name: values,
            "labels": [self.label_to_id[v] for v in batch[self.label_column]],
            "length": [len(v) for v in values],
        }


@dataclass(frozen=True)
class AudioCollator:
    """Pads each batch to its longest clip with the extractor's own padding (and attention mask)."""

    extractor: Any

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        input_name = self.extractor.model_input_names[0]
        inputs = [{input_name: np.asarray(f[input_name])} for f in features]
        batch = dict(self.extractor.pad(inputs, padding="longest", return_tensors="pt"))
        batch["labels"] = torch.as_tensor([int(f["labels"]) for f in features], dtype=torch.long)
        return batch
