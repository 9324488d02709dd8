"""Audio data: soundfile decoding, resampling to the extractor's rate, cutting, dynamic padding."""

from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import pytest
import soundfile
from datasets import Audio, Dataset
from transformers import Wav2Vec2FeatureExtractor

from tests.trainer_core.datagen import AUDIO_CLASSES, tiny_audio_spec, write_audio_folder
from trainer_core.data import load_processor, prepare_data
from trainer_core.data.audio import load_clip, resample
from trainer_core.spec import SpecError, parse_spec


@pytest.fixture
def audio_dir(tmp_path: Path) -> Path:
    return write_audio_folder(tmp_path / "audio", n_train_per_class=3, n_val_per_class=2)


def _wav_lengths(folder: Path) -> dict[str, int]:
    return {str(p): soundfile.info(str(p)).frames for p in folder.rglob("*.wav")}


def test_audiofolder_is_resampled_to_16k_and_padded_per_batch(audio_dir: Path) -> None:
    data = prepare_data(parse_spec(tiny_audio_spec(audio_dir)), None)

    assert data.labels == sorted(AUDIO_CLASSES)
    assert data.processor.sampling_rate == 16000
    assert data.eval is not None and (len(data.train), len(data.eval)) == (6, 4)
    assert set(data.train.column_names) == {"input_values", "labels", "length"}
    # Files are 8 kHz: every clip doubles in length; lengths are the per-row sample counts.
    expected = sorted(2 * n for path, n in _wav_lengths(audio_dir).items() if "/train/" in path)
    assert sorted(int(n) for n in data.train["length"]) == expected
    assert [len(r["input_values"]) for r in data.train] == [int(n) for n in data.train["length"]]

    rows = [data.train[i] for i in range(4)]
    batch = data.collator(rows)
    longest = max(int(r["length"]) for r in rows)
    assert batch["input_values"].shape == (4, longest)
    assert "attention_mask" not in batch  # group-norm wav2vec2 must not get one
    assert batch["labels"].tolist() == [int(r["labels"]) for r in rows]
    shortest = int(np.argmin([int(r["length"]) for r in rows]))
    assert float(batch["input_values"][shortest, int(rows[shortest]["length"]) :].abs().sum()) == 0.0


def test_max_duration_cuts_clips(audio_dir: Path) -> None:
    spec = tiny_audio_spec(audio_dir, preprocessing={"max_duration_s": 0.1})
    data = prepare_data(parse_spec(spec), None)
    assert {int(n) for n in data.train["length"]} == {1600}


def test_sampling_rate_sets_a_default_extractor_and_skips_resampling(audio_dir: Path) -> None:
    data = prepare_data(parse_spec(tiny_audio_spec(audio_dir, preprocessing={"sampling_rate": 8000})), None)
    assert data.processor.sampling_rate == 8000
    expected = sorted(n for path, n in _wav_lengths(audio_dir).items() if "/train/" in path)
    assert sorted(int(n) for n in data.train["length"]) == expected


def test_named_extractor_keeps_its_rate(tmp_path: Path) -> None:
    Wav2Vec2FeatureExtractor(sampling_rate=16000).save_pretrained(tmp_path / "fe")
    spec = tiny_audio_spec("unused", model={"processor": str(tmp_path / "fe")})
    assert load_processor(parse_spec(spec)).sampling_rate == 16000
    spec["preprocessing"]["sampling_rate"] = 22050
    with pytest.raises(SpecError) as info:
        load_processor(parse_spec(spec))
    assert info.value.errors[0].field == "preprocessing.sampling_rate"


def test_resampling_preserves_a_tone() -> None:
    freq, seconds = 440.0, 0.5
    for orig, target in ((8000, 16000), (22050, 16000)):
        t_in = np.arange(int(orig * seconds)) / orig
        out = resample(np.sin(2 * math.pi * freq * t_in).astype(np.float32), orig, target)
        assert out.size == round(t_in.size * target / orig)
        t_out = np.arange(out.size) / target
        inner = slice(8, -8)  # the filter's edges are not representative
        error = np.abs(out - np.sin(2 * math.pi * freq * t_out))[inner].max()
        assert error < 0.05, (orig, target, error)


def test_clip_from_bytes_is_mono_and_cut() -> None:
    stereo = np.stack([np.full(8000, 0.5), np.full(8000, -0.1)], axis=1).astype(np.float32)
    buffer = io.BytesIO()
    soundfile.write(buffer, stereo, 8000, format="WAV")
    clip = load_clip({"bytes": buffer.getvalue(), "path": None}, 8000, max_duration_s=0.25)
    assert clip.shape == (2000,)
    assert np.allclose(clip, 0.2, atol=1e-3)


def test_audio_feature_columns_are_decoded_without_torchcodec(audio_dir: Path, tmp_path: Path) -> None:
    paths = sorted(str(p) for p in (audio_dir / "train").rglob("*.wav"))
    table = Dataset.from_dict({"clip": paths, "pitch": [Path(p).parent.name for p in paths]})
    table.cast_column("clip", Audio()).to_parquet(str(tmp_path / "clips.parquet"))
    spec = tiny_audio_spec(
        audio_dir,
        dataset={"path": "parquet", "data_dir": None, "data_files": {"train": str(tmp_path / "clips.parquet")},
                 "audio_column": "clip", "label_column": "pitch"},
    )
    data = prepare_data(parse_spec(spec), None)
    assert data.labels == ["high", "low"] and len(data.train) == 6
    expected = sorted(2 * n for path, n in _wav_lengths(audio_dir).items() if "/train/" in path)
    assert sorted(int(n) for n in data.train["length"]) == expected


def test_unknown_audio_column_names_the_field(audio_dir: Path) -> None:
    with pytest.raises(SpecError) as info:
        prepare_data(parse_spec(tiny_audio_spec(audio_dir, dataset={"audio_column": "wav"})), None)
    error = info.value.errors[0]
    assert error.field == "dataset.audio_column" and "audio, label" in error.message


def test_audio_cache_hit_reloads_the_feature_extractor(audio_dir: Path, tmp_path: Path) -> None:
    spec = parse_spec(tiny_audio_spec(audio_dir))
    first = prepare_data(spec, tmp_path / "cache")
    second = prepare_data(spec, tmp_path / "cache")
    assert second.cache_hit and not first.cache_hit
    assert second.processor.to_dict() == first.processor.to_dict()
    assert np.array_equal(second.train[0]["input_values"], first.train[0]["input_values"])
