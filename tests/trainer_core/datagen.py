"""Test-data factories: tiny, clearly learnable datasets written to disk, and specs that train on them.

Plain functions so every trainer_core test (data, backends, run) builds the same data the same way.
"""

from __future__ import annotations

import copy
import csv
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import soundfile
from PIL import Image

T = TypeVar("T")

POSITIVE = [
    "wonderful", "great", "excellent", "delightful", "superb", "fantastic", "lovely", "brilliant",
    "amazing", "charming", "enjoyable", "marvelous",
]
NEGATIVE = [
    "terrible", "awful", "horrible", "dreadful", "boring", "disappointing", "poor", "miserable",
    "annoying", "painful", "ugly", "disgusting",
]
SUBJECTS = ["the movie", "this film", "the food", "our stay", "the service", "the book", "the concert",
            "the hotel", "this phone", "the game", "the show", "the meal"]
POSITIVE_TAILS = ["i would go again", "we loved every minute", "highly recommended", "what a joy",
                  "it made my day"]
NEGATIVE_TAILS = ["i want my money back", "we left early", "never again", "what a waste",
                  "it ruined my day"]
FILLERS = ["to be honest", "all things considered", "from start to finish", "in my opinion",
           "for the price", "on the whole"]


def _review(rng: random.Random, positive: bool) -> str:
    words = POSITIVE if positive else NEGATIVE
    tails = POSITIVE_TAILS if positive else NEGATIVE_TAILS
    parts = [f"{rng.choice(SUBJECTS)} was {rng.choice(words)}"]
    # Varying lengths give dynamic padding and length grouping something to save.
    for _ in range(rng.randint(0, 3)):
        parts.append(rng.choice([rng.choice(FILLERS), f"really {rng.choice(words)}", rng.choice(tails)]))
    return ", ".join(parts) + "."


def write_sentiment_csv(directory: str | Path, n_train: int = 240, n_val: int = 60, seed: int = 0) -> dict[str, str]:
    """``train.csv`` and ``validation.csv`` (columns ``text``, ``label`` = positive/negative), balanced.

    Returns the ``data_files`` mapping for a spec.
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    files: dict[str, str] = {}
    for split, n in (("train", n_train), ("validation", n_val)):
        path = root / f"{split}.csv"
        with path.open("w", newline="", encoding="utf-8") as fh:
            writer = csv.writer(fh)
            writer.writerow(["text", "label"])
            for i in range(n):
                positive = i % 2 == 0
                writer.writerow([_review(rng, positive), "positive" if positive else "negative"])
        files[split] = str(path)
    return files


def _class_files(
    directory: str | Path, n_train: int, n_val: int, classes: dict[str, T]
) -> Iterator[tuple[Path, T]]:
    """``<dir>/{train,validation}/<class>/<i>`` stems (folders made) with each class's value."""
    for split, n in (("train", n_train), ("validation", n_val)):
        for name, value in classes.items():
            folder = Path(directory) / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                yield folder / str(i), value


# Each class is an image dominated by one colour channel: trivially separable, yet real PNGs.
IMAGE_CLASSES = {"red": 0, "green": 1, "blue": 2}


def write_image_folder(
    directory: str | Path, n_train_per_class: int = 16, n_val_per_class: int = 6, size: int = 32, seed: int = 0
) -> Path:
    """An imagefolder ``<dir>/{train,validation}/{red,green,blue}/*.png`` of noisy one-colour images."""
    rng = np.random.default_rng(seed)
    for stem, channel in _class_files(directory, n_train_per_class, n_val_per_class, IMAGE_CLASSES):
        pixels = rng.integers(0, 90, size=(size, size, 3))
        pixels[..., channel] = rng.integers(170, 256, size=(size, size))
        Image.fromarray(pixels.astype(np.uint8), "RGB").save(stem.with_suffix(".png"))
    return Path(directory)


# Tones far apart in pitch; files are written at 8 kHz so loading must resample to the model's rate.
AUDIO_CLASSES = {"low": 220.0, "high": 1760.0}


def write_audio_folder(
    directory: str | Path,
    n_train_per_class: int = 16,
    n_val_per_class: int = 6,
    sampling_rate: int = 8000,
    seed: int = 0,
) -> Path:
    """An audiofolder ``<dir>/{train,validation}/{low,high}/*.wav`` of noisy sine tones, 0.25-0.5 s."""
    rng = np.random.default_rng(seed)
    for stem, freq in _class_files(directory, n_train_per_class, n_val_per_class, AUDIO_CLASSES):
        duration = rng.uniform(0.25, 0.5)
        t = np.arange(int(duration * sampling_rate)) / sampling_rate
        detune = freq * rng.uniform(0.95, 1.05)
        wave = rng.uniform(0.3, 0.8) * np.sin(2 * math.pi * detune * t + rng.uniform(0, 2 * math.pi))
        wave += rng.normal(0.0, 0.02, size=t.shape)
        soundfile.write(stem.with_suffix(".wav"), wave.astype(np.float32), sampling_rate)
    return Path(directory)


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Deep-merge ``overrides`` into a copy of ``base`` (dicts merge, anything else replaces)."""
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


TINY_BERT = {
    "model_type": "bert", "vocab_size": 1000, "hidden_size": 32, "num_hidden_layers": 2,
    "num_attention_heads": 2, "intermediate_size": 37, "max_position_embeddings": 128,
}
TINY_VIT = {
    "model_type": "vit", "image_size": 32, "patch_size": 8, "num_channels": 3, "hidden_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 37,
}
# wav2vec2 with a two-layer feature encoder (total stride 20), no SpecAugment masking: tiny clips.
TINY_WAV2VEC2 = {
    "model_type": "wav2vec2", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
    "intermediate_size": 37, "conv_dim": [32, 32], "conv_stride": [5, 4], "conv_kernel": [10, 8],
    "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 2, "mask_time_prob": 0.0,
    "classifier_proj_size": 32, "feat_extract_norm": "group", "do_stable_layer_norm": False,
}


def tiny_text_spec(
    data_files: dict[str, str], model_path: str | Path | None = None, **overrides: Any
) -> dict[str, Any]:
    """A text-classification spec on ``data_files``: tiny config-built BERT (trained tokenizer), or the
    pretrained model at ``model_path`` (e.g. the packaged MiniLM). ``overrides`` deep-merge in."""
    model: dict[str, Any] = {"name_or_path": str(model_path)} if model_path else {"config": dict(TINY_BERT)}
    spec = {
        "name": "tiny-text",
        "task": "text-classification",
        "model": model,
        "dataset": {"path": "csv", "data_files": dict(data_files), "text_column": "text", "label_column": "label"},
        "preprocessing": {"max_length": 64},
        # The pretrained MiniLM reaches 1.0 validation accuracy after one epoch; random init needs more.
        "training": {"num_train_epochs": 2 if model_path else 3, "per_device_train_batch_size": 16,
                     "per_device_eval_batch_size": 32, "learning_rate": 1e-4 if model_path else 1e-3,
                     "seed": 42, "logging_steps": 5},
        "metrics": ["accuracy", "f1"],
    }
    return _merge(spec, overrides)


def _folder_spec(task: str, builder: str, model_config: dict[str, Any], data_dir: str | Path,
                 epochs: int, overrides: dict[str, Any]) -> dict[str, Any]:
    """A spec for a config-built model on an image/audio folder (one class per subfolder)."""
    spec = {
        "name": f"tiny-{task.split('-')[0]}",
        "task": task,
        "model": {"config": dict(model_config)},
        "dataset": {"path": builder, "data_dir": str(data_dir)},
        "training": {"num_train_epochs": epochs, "per_device_train_batch_size": 8,
                     "per_device_eval_batch_size": 16, "learning_rate": 1e-3, "seed": 42, "logging_steps": 2},
        "metrics": ["accuracy", "f1"],
    }
    return _merge(spec, overrides)


def tiny_image_spec(data_dir: str | Path, **overrides: Any) -> dict[str, Any]:
    """An image-classification spec on an imagefolder with a config-built tiny ViT (32 px, patch 8)."""
    return _folder_spec("image-classification", "imagefolder", TINY_VIT, data_dir, 3, overrides)


def tiny_audio_spec(data_dir: str | Path, **overrides: Any) -> dict[str, Any]:
    """An audio-classification spec on an audiofolder with a config-built tiny wav2vec2 (16 kHz).

    Clips are at most 0.5 s, so ``max_duration_s`` 1.0 keeps them whole.
    """
    overrides = _merge({"preprocessing": {"max_duration_s": 1.0}}, overrides)
    return _folder_spec("audio-classification", "audiofolder", TINY_WAV2VEC2, data_dir, 4, overrides)
