"""On-disk cache of preprocessed datasets, keyed by everything that shapes them.

An entry is ``cache_dir/<key>/`` holding ``train/`` (and ``eval/``) written by ``save_to_disk``, the
processor in ``processor/`` (a trained tokenizer must be reused as is) and ``meta.json``. Entries are
written to a temporary folder and renamed into place, so a crashed run never leaves half an entry.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datasets import Dataset, load_from_disk

from trainer_core.data.causal_lm import LM_ENCODING_RECIPE
from trainer_core.data.packing import PACKING_RECIPE
from trainer_core.data.preference import PREFERENCE_ENCODING_RECIPE
from trainer_core.spec import BUILTIN_DATASET_BUILDERS, DatasetSpec, JobSpec

logger = logging.getLogger(__name__)

CACHE_FORMAT = 1
# Weights do not change how data is preprocessed; hashing gigabytes of them would only cost time.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".gguf")
_STALE_TMP_S = 24 * 3600
_LM_COLUMNS = ("prompt_column", "completion_column", "messages_column")


def file_digest(path: Path) -> str:
    """sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def tree_digest(root: Path, files: Iterable[Path]) -> dict[str, str]:
    """``{path relative to root: sha256}``; names count too (folder names are labels in imagefolder)."""
    return {str(p.relative_to(root)): file_digest(p) for p in sorted(files) if p.is_file()}


def _data_file_patterns(ds: DatasetSpec) -> dict[str, list[str]]:
    files = ds.data_files
    if files is None:
        return {}
    if isinstance(files, str):
        return {"train": [files]}
    if isinstance(files, list):
        return {"train": list(files)}
    return {split: [v] if isinstance(v, str) else list(v) for split, v in files.items()}


def data_fingerprint(ds: DatasetSpec) -> dict[str, Any]:
    """Content hash of every local data file; for a hub dataset, its id, configuration and files named."""
    is_local = ds.path in BUILTIN_DATASET_BUILDERS or (ds.path is not None and Path(ds.path).exists())
    if not is_local:
        return {"hub": ds.path, "name": ds.name, "data_dir": ds.data_dir, "data_files": ds.data_files}
    out: dict[str, Any] = {"path": ds.path, "name": ds.name}
    base = Path(ds.data_dir) if ds.data_dir else None
    if base is not None and not ds.data_files:
        out["data_dir"] = tree_digest(base, base.rglob("*"))
    if ds.path not in BUILTIN_DATASET_BUILDERS:
        root = Path(str(ds.path))
        out["local_dataset"] = tree_digest(root, root.rglob("*")) if root.is_dir() else file_digest(root)
    for split, patterns in _data_file_patterns(ds).items():
        digests: dict[str, str] = {}
        for pattern in patterns:
            full = pattern if base is None or os.path.isabs(pattern) else str(base / pattern)
            for match in sorted(glob.glob(full, recursive=True)) or [full]:
                path = Path(match)
                digests[pattern + "::" + match] = file_digest(path) if path.is_file() else "missing"
        out.setdefault("data_files", {})[split] = digests
    return out


def processor_fingerprint(source: str | None, revision: str | None) -> dict[str, Any]:
    """Identity of a named tokenizer/processor: its files' hashes for a local folder, else id + revision."""
    if source is None:
        return {}
    root = Path(source)
    if root.is_dir():
        files = [p for p in root.iterdir() if p.is_file() and not p.name.endswith(_WEIGHT_SUFFIXES)]
        return {"local": tree_digest(root, files)}
    return {"hub": source, "revision": revision}


def cache_key(spec: JobSpec, processor_identity: dict[str, Any]) -> str:
    """sha256 over the data, the processor, the task, columns, preprocessing and eval split settings."""
    ds = spec.dataset
    parts = {
        "format": CACHE_FORMAT,
        "task": spec.task,
        "data": data_fingerprint(ds),
        "processor": processor_identity,
        "columns": ds.model_dump(include={"text_column", "text_pair_column", "image_column", "audio_column",
                                          "label_column", *_LM_COLUMNS}),
        # How causal-lm rows are tokenised and masked (bumped when that changes).
        "encoding": _encoding_recipe(spec),
        "splits": {
            "train_split": ds.train_split,
            "eval_split": ds.eval_split,
            "eval_fraction": ds.eval_fraction,
            # The seed only picks rows when train is split; elsewhere it must not invalidate the cache.
            "seed": spec.training.seed if ds.eval_fraction is not None else None,
        },
        # group_by_length changes batching, not the preprocessed rows.
        "preprocessing": spec.preprocessing.model_dump(exclude={"group_by_length"}),
    }
    if spec.task == "causal-lm" and spec.preprocessing.packing:  # unpacked keys stay as they were
        parts["packing"] = PACKING_RECIPE
    if spec.is_preference:  # SFT keys stay as they were
        parts["preference_columns"] = ds.model_dump(include={"chosen_column", "rejected_column"})
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _encoding_recipe(spec: JobSpec) -> str | None:
    """How text rows become model rows: preference pairs (dpo/orpo) and SFT rows never share an entry."""
    if spec.is_preference:
        return PREFERENCE_ENCODING_RECIPE
    return LM_ENCODING_RECIPE if spec.task == "causal-lm" else None


@dataclass
class CacheEntry:
    """A cache entry as loaded from disk."""

    train: Dataset
    eval: Dataset | None
    labels: list[str]
    processor_dir: Path


def load_entry(cache_dir: Path, key: str) -> CacheEntry | None:
    """The entry for ``key``, or None when there is none (or it cannot be read; it is then rebuilt)."""
    root = cache_dir / key
    meta_path = root / "meta.json"
    if not meta_path.is_file():
        return None
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
        if meta.get("format") != CACHE_FORMAT:
            return None
        train = load_from_disk(str(root / "train"))
        eval_split = load_from_disk(str(root / "eval")) if meta["has_eval"] else None
    except (OSError, ValueError, KeyError) as exc:
        logger.warning("preprocessing cache entry %s is unreadable (%s); rebuilding it", root, exc)
        _discard(root)
        return None
    assert isinstance(train, Dataset) and (eval_split is None or isinstance(eval_split, Dataset))
    return CacheEntry(train=train, eval=eval_split, labels=list(meta["labels"]), processor_dir=root / "processor")


def save_entry(cache_dir: Path, key: str, train: Dataset, eval_split: Dataset | None, labels: list[str],
               processor: Any) -> Path:
    """Write an entry atomically: build it in a temporary folder, then rename it into place."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(cache_dir)
    tmp = cache_dir / f".tmp-{key}-{uuid.uuid4().hex}"
    final = cache_dir / key
    try:
        train.save_to_disk(str(tmp / "train"))
        if eval_split is not None:
            eval_split.save_to_disk(str(tmp / "eval"))
        processor.save_pretrained(str(tmp / "processor"))
        meta = {"format": CACHE_FORMAT, "labels": labels, "has_eval": eval_split is not None}
        (tmp / "meta.json").write_text(json.dumps(meta), encoding="utf-8")
        if final.exists() and not (final / "meta.json").is_file():
            _discard(final)  # the remains of a writer that died before finishing
        os.rename(tmp, final)
    except OSError:
        if final.joinpath("meta.json").is_file():
            # Another process (e.g. another rank) wrote the same entry first; theirs is identical.
            logger.info("preprocessing cache entry %s was written concurrently; using it", final)
        else:
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def _discard(entry: Path) -> None:
    """Move an entry out of its key's place first, so no reader ever sees it half deleted."""
    doomed = entry.with_name(f".tmp-discard-{uuid.uuid4().hex}")
    try:
        os.rename(entry, doomed)
    except OSError:
        return
    shutil.rmtree(doomed, ignore_errors=True)


def _remove_stale_tmp(cache_dir: Path) -> None:
    """Temporary folders left by crashed runs; recent ones may belong to a run still writing."""
    now = time.time()
    for tmp in cache_dir.glob(".tmp-*"):
        try:
            if now - tmp.stat().st_mtime > _STALE_TMP_S:
                shutil.rmtree(tmp, ignore_errors=True)
        except OSError:
            continue
