"""Image data: imagefolder labels, the default processor of a config-built ViT, RGB conversion."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from tests.trainer_core.datagen import IMAGE_CLASSES, tiny_image_spec, write_image_folder
from trainer_core.data import load_processor, prepare_data
from trainer_core.spec import SpecError, parse_spec


@pytest.fixture
def image_dir(tmp_path: Path) -> Path:
    return write_image_folder(tmp_path / "images", n_train_per_class=4, n_val_per_class=2)


def test_imagefolder_with_tiny_vit_gives_sized_pixel_values_and_folder_labels(image_dir: Path) -> None:
    data = prepare_data(parse_spec(tiny_image_spec(image_dir)), None)

    assert data.labels == sorted(IMAGE_CLASSES)  # ClassLabel names from the folder names
    assert data.eval is not None and (len(data.train), len(data.eval)) == (12, 6)
    assert set(data.train.column_names) == {"pixel_values", "labels", "length"}
    row = data.train[0]
    assert row["pixel_values"].shape == (3, 32, 32) and row["pixel_values"].dtype == np.float32
    # Each folder's images are dominated by their colour channel, so the label is visible in the pixels.
    for example in data.train:
        channel = IMAGE_CLASSES[data.labels[int(example["labels"])]]
        assert int(example["pixel_values"].mean(axis=(1, 2)).argmax()) == channel

    batch = data.collator([data.train[i] for i in range(5)])
    assert set(batch) == {"pixel_values", "labels"}
    assert batch["pixel_values"].shape == (5, 3, 32, 32) and batch["labels"].dtype == torch.long


def test_default_processor_follows_config_image_size() -> None:
    spec = parse_spec(tiny_image_spec("unused", model={"config": {"image_size": 48}}))
    processor = load_processor(spec)
    assert processor.size == {"height": 48, "width": 48}


def test_model_type_without_image_processor_names_model_processor() -> None:
    spec = parse_spec(tiny_image_spec("unused", model={"config": {"model_type": "bert"}}))
    with pytest.raises(SpecError) as info:
        load_processor(spec)
    assert info.value.errors[0].field == "model.processor"


def test_grey_and_rgba_images_become_rgb(tmp_path: Path) -> None:
    for split in ("train", "validation"):
        for name, mode in (("grey", "L"), ("alpha", "RGBA")):
            folder = tmp_path / "mixed" / split / name
            folder.mkdir(parents=True)
            for i in range(2):
                Image.new(mode, (20, 12), color=200 if mode == "L" else (10, 200, 30, 128)).save(folder / f"{i}.png")
    data = prepare_data(parse_spec(tiny_image_spec(tmp_path / "mixed")), None)
    assert data.train[0]["pixel_values"].shape == (3, 32, 32)


def test_csv_of_image_paths_with_string_labels(image_dir: Path, tmp_path: Path) -> None:
    rows = [[str(p), p.parent.name] for p in sorted((image_dir / "train").rglob("*.png"))]
    path = tmp_path / "images.csv"
    with path.open("w", newline="", encoding="utf-8") as fh:
        csv.writer(fh).writerows([["file", "colour"], *rows])
    spec = tiny_image_spec(
        image_dir,
        dataset={"path": "csv", "data_dir": None, "data_files": {"train": str(path)},
                 "image_column": "file", "label_column": "colour", "eval_fraction": 0.25},
    )
    data = prepare_data(parse_spec(spec), None)
    assert data.labels == ["blue", "green", "red"]
    assert data.eval is not None and len(data.train) + len(data.eval) == 12


def test_unknown_image_column_names_the_field(image_dir: Path) -> None:
    with pytest.raises(SpecError) as info:
        prepare_data(parse_spec(tiny_image_spec(image_dir, dataset={"image_column": "img"})), None)
    error = info.value.errors[0]
    assert error.field == "dataset.image_column" and "image, label" in error.message


def test_image_cache_hit_reloads_the_processor(image_dir: Path, tmp_path: Path) -> None:
    spec = parse_spec(tiny_image_spec(image_dir))
    first = prepare_data(spec, tmp_path / "cache")
    second = prepare_data(spec, tmp_path / "cache")
    assert second.cache_hit and not first.cache_hit
    assert second.processor.size == first.processor.size == {"height": 32, "width": 32}
    assert np.array_equal(second.train[0]["pixel_values"], first.train[0]["pixel_values"])
    # A new image changes the data hash.
    Image.new("RGB", (32, 32), (255, 0, 0)).save(image_dir / "train" / "red" / "extra.png")
    assert not prepare_data(spec, tmp_path / "cache").cache_hit
