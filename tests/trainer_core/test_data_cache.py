"""The on-disk preprocessing cache: hits on identical inputs, rebuilds when any part of the key changes."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.trainer_core.datagen import tiny_text_spec, write_sentiment_csv
from trainer_core.data import prepare_data
from trainer_core.data.cache import save_entry
from trainer_core.data.text import TextEncoder, train_wordpiece
from trainer_core.spec import parse_spec


@pytest.fixture
def files(tmp_path: Path) -> dict[str, str]:
    return write_sentiment_csv(tmp_path / "csv", n_train=30, n_val=8)


@pytest.fixture
def forbid_tokenisation(monkeypatch: pytest.MonkeyPatch) -> None:
    """After this fixture, tokenising a row fails: a cache hit must not need to."""

    def refuse(self: TextEncoder, batch: Any) -> Any:
        raise AssertionError("re-tokenised on what should be a cache hit")

    monkeypatch.setattr(TextEncoder, "__call__", refuse)


def test_second_run_is_a_hit_without_retokenising(
    files: dict[str, str], minilm_path: Path, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    spec = parse_spec(tiny_text_spec(files, minilm_path))
    cache = tmp_path / "cache"
    first = prepare_data(spec, cache)
    assert not first.cache_hit
    assert (cache / first.cache_key / "meta.json").is_file()

    request.getfixturevalue("forbid_tokenisation")
    with pytest.raises(AssertionError, match="re-tokenised"):
        prepare_data(spec, None)  # proves the guard bites when tokenising does happen
    second = prepare_data(spec, cache)
    assert second.cache_hit and second.cache_key == first.cache_key
    assert second.labels == first.labels
    assert second.train["input_ids"] == first.train["input_ids"]
    assert second.eval is not None and first.eval is not None
    assert second.eval["labels"] == first.eval["labels"]
    assert second.processor("great film")["input_ids"] == first.processor("great film")["input_ids"]
    assert second.collator([second.train[0]])["input_ids"].shape[0] == 1


def test_trained_tokenizer_is_stored_and_reused(files: dict[str, str], tmp_path: Path) -> None:
    spec = parse_spec(tiny_text_spec(files))
    first = prepare_data(spec, tmp_path / "cache")
    second = prepare_data(spec, tmp_path / "cache")
    assert second.cache_hit
    assert second.processor.get_vocab() == first.processor.get_vocab()
    assert (tmp_path / "cache" / first.cache_key / "processor" / "tokenizer.json").is_file()


def test_trained_tokenizer_is_deterministic(files: dict[str, str]) -> None:
    texts = Path(files["train"]).read_text(encoding="utf-8").splitlines()
    assert train_wordpiece(texts, 500, 64).get_vocab() == train_wordpiece(texts, 500, 64).get_vocab()


def _key(spec: dict[str, Any], cache: Path) -> tuple[str, bool]:
    data = prepare_data(parse_spec(spec), cache)
    return data.cache_key, data.cache_hit


def test_changing_max_length_rebuilds(files: dict[str, str], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    key, _ = _key(tiny_text_spec(files), cache)
    new_key, hit = _key(tiny_text_spec(files, preprocessing={"max_length": 16}), cache)
    assert not hit and new_key != key
    assert _key(tiny_text_spec(files), cache) == (key, True)


def test_changing_one_byte_of_a_data_file_rebuilds(files: dict[str, str], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    key, _ = _key(tiny_text_spec(files), cache)
    path = Path(files["validation"])
    text = path.read_text(encoding="utf-8")
    path.write_text(text.replace("was", "wax", 1), encoding="utf-8")
    new_key, hit = _key(tiny_text_spec(files), cache)
    assert not hit and new_key != key


def test_changing_the_tokenizer_rebuilds(files: dict[str, str], minilm_path: Path, tmp_path: Path) -> None:
    tokenizer_dir = tmp_path / "tok"
    tokenizer_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json"):
        shutil.copy(minilm_path / name, tokenizer_dir / name)
    cache = tmp_path / "cache"
    spec = tiny_text_spec(files, model={"tokenizer": str(tokenizer_dir)})
    key, _ = _key(spec, cache)
    assert _key(spec, cache) == (key, True)
    # A different tokenizer (the trained one) and an edited tokenizer file each change the key.
    assert _key(tiny_text_spec(files), cache)[0] != key
    config = tokenizer_dir / "tokenizer_config.json"
    config.write_text(config.read_text(encoding="utf-8") + "\n", encoding="utf-8")
    new_key, hit = _key(spec, cache)
    assert not hit and new_key != key


def test_seed_matters_only_for_eval_fraction(files: dict[str, str], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with_val = [tiny_text_spec(files, training={"seed": s}) for s in (1, 2)]
    assert _key(with_val[0], cache)[0] == _key(with_val[1], cache)[0]
    single = {"train": files["train"]}
    held_out = [tiny_text_spec(single, dataset={"eval_fraction": 0.2}, training={"seed": s}) for s in (1, 2)]
    assert _key(held_out[0], cache)[0] != _key(held_out[1], cache)[0]


def test_half_written_entry_is_not_a_hit(files: dict[str, str], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    spec = parse_spec(tiny_text_spec(files))
    key = prepare_data(spec, cache).cache_key
    (cache / key / "meta.json").unlink()  # as if a writer died before finishing
    rebuilt = prepare_data(spec, cache)
    assert not rebuilt.cache_hit and (cache / key / "meta.json").is_file()
    assert prepare_data(spec, cache).cache_hit


class _FailingProcessor:
    def save_pretrained(self, path: str) -> None:
        raise OSError("disk full")


def test_failed_write_leaves_no_entry_and_no_temporary_folder(files: dict[str, str], tmp_path: Path) -> None:
    data = prepare_data(parse_spec(tiny_text_spec(files)), None)
    cache = tmp_path / "cache"
    with pytest.raises(OSError, match="disk full"):
        save_entry(cache, "k", data.train, data.eval, data.labels, _FailingProcessor())
    assert list(cache.iterdir()) == []


def test_unreadable_entry_is_rebuilt(files: dict[str, str], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    spec = parse_spec(tiny_text_spec(files))
    key = prepare_data(spec, cache).cache_key
    shutil.rmtree(cache / key / "train")  # meta.json says complete, but the data is gone
    rebuilt = prepare_data(spec, cache)
    assert not rebuilt.cache_hit and len(rebuilt.train) == 30
    assert prepare_data(spec, cache).cache_hit


def test_concurrent_writer_keeps_the_first_complete_entry(files: dict[str, str], tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    data = prepare_data(parse_spec(tiny_text_spec(files)), cache)
    meta = cache / data.cache_key / "meta.json"
    before = meta.stat().st_mtime_ns
    save_entry(cache, data.cache_key, data.train, data.eval, data.labels, data.processor)
    assert meta.stat().st_mtime_ns == before
    assert [p.name for p in cache.iterdir()] == [data.cache_key]
