"""Image inputs: the model's image processor (or a default one for config-built models), RGB conversion."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image
from transformers import AutoImageProcessor, PreTrainedConfig
from transformers.models.auto.image_processing_auto import (
    IMAGE_PROCESSOR_MAPPING_NAMES,
    get_image_processor_class_from_name,
)
from transformers.utils import is_torchvision_available

from trainer_core.data.loading import file_source, spec_error
from trainer_core.spec import JobSpec


def load_image_processor(spec: JobSpec, model_config: PreTrainedConfig | None) -> Any:
    """``model.processor``, else the pretrained model's own, else a default for the config's model type."""
    source = spec.model.processor or spec.model.name_or_path
    if source is not None:
        revision = spec.model.revision if spec.model.processor is None else None
        return AutoImageProcessor.from_pretrained(source, revision=revision)
    assert model_config is not None, "config-built models pass their config"
    return default_image_processor(model_config)


def default_image_processor(model_config: PreTrainedConfig) -> Any:
    """The model type's image processor with default settings, sized to ``config.image_size``.

    The PIL backend is used when torchvision is missing; both produce the same ``pixel_values``.
    """
    model_type = model_config.model_type
    backends = IMAGE_PROCESSOR_MAPPING_NAMES.get(model_type)
    if not backends:
        raise spec_error(
            "model.processor", f"no default image processor for model_type {model_type!r}; name one in model.processor"
        )
    preferred = ("torchvision", "pil") if is_torchvision_available() else ("pil", "torchvision")
    names = [backends[b] for b in preferred if backends.get(b)]
    cls = next((c for c in map(get_image_processor_class_from_name, names) if c is not None), None)
    if cls is None:
        raise spec_error("model.processor", f"cannot import an image processor for model_type {model_type!r}")
    processor = cls()
    image_size = getattr(model_config, "image_size", None)
    if isinstance(image_size, (list, tuple)):
        height, width = int(image_size[0]), int(image_size[-1])
    elif image_size is not None:
        height = width = int(image_size)
    else:
        return processor  # the model takes any size (e.g. ConvNeXt); keep the processor's default
    size = getattr(processor, "size", None) or {}
    processor.size = {"shortest_edge": height} if "shortest_edge" in size else {"height": height, "width": width}
    if getattr(processor, "crop_size", None):
        processor.crop_size = {"height": height, "width": width}
    return processor


def to_rgb(value: Any) -> Image.Image:
    """A PIL RGB image from what an image column holds: a PIL image, a path, or ``{bytes, path}``."""
    image = value if isinstance(value, Image.Image) else Image.open(file_source(value, "dataset.image_column"))
    # Grey-scale, palette and RGBA images all become 3-channel RGB, which every processor expects.
    return image.convert("RGB")


@dataclass(frozen=True)
class ImageEncoder:
    """Turns a batch of rows into ``pixel_values`` with the image processor."""

    processor: Any
    image_column: str
    label_column: str
    label_to_id: Mapping[Any, int]

    def __call__(self, batch: Mapping[str, list[Any]]) -> dict[str, list[Any]]:
        images = [to_rgb(v) for v in batch[self.image_column]]
        pixels = self.processor(images=images, return_tensors="np")["pixel_values"]
        return {
            "pixel_values": [np.asarray(p, dtype=np.float32) for p in pixels],
            "labels": [self.label_to_id[v] for v in batch[self.label_column]],
            # Every image has the same size after processing, so length grouping is a no-op.
            "length": [1] * len(images),
        }


@dataclass(frozen=True)
class ImageCollator:
    """Stacks ``pixel_values`` and ``labels``; images need no padding."""

    def __call__(self, features: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return {
            "pixel_values": torch.as_tensor(np.stack([np.asarray(f["pixel_values"]) for f in features])),
            "labels": torch.as_tensor([int(f["labels"]) for f in features], dtype=torch.long),
        }
