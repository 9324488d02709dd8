"""A bounded look at a dataset: each split's files, its first rows and its row count, without a full load.

Preflight reads data this way instead of ``datasets.load_dataset``, which would read (and cache) every
file. The rows are parsed as the run's builders parse them: files are resolved by ``datasets``' own
pattern rules, CSV with the csv builder's pandas options, folders by the folder builders' extensions with
the parent folder as label. Files no larger than :data:`HEAD_BYTES` are read whole, so their row count
and label set are exact; a bigger file contributes its first :data:`HEAD_ROWS` rows and an estimated count.
Files are opened through fsspec, so an object-store URL (``s3://...``) is read the same way, a head at a time.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fsspec
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from datasets import Dataset, DownloadConfig
from datasets.data_files import DataFilesDict, EmptyDatasetError, get_data_patterns, sanitize_patterns
from datasets.packaged_modules.audiofolder.audiofolder import AudioFolder
from datasets.packaged_modules.csv.csv import CsvConfig
from datasets.packaged_modules.imagefolder.imagefolder import ImageFolder
from datasets.table import InMemoryTable

from trainer_core.data.loading import spec_error
from trainer_core.spec import JobSpec

HEAD_BYTES = 2 << 20  # a file up to this size is read whole
HEAD_ROWS = 1000  # rows taken from the start of a bigger file
_SAMPLE_BYTES = 64 << 10  # bytes whose line count estimates a big file's row count
FOLDER_EXTENSIONS = {"imagefolder": ImageFolder.EXTENSIONS, "audiofolder": AudioFolder.EXTENSIONS}
FOLDER_COLUMNS = {"imagefolder": "image", "audiofolder": "audio"}
SUFFIX_FORMATS = {".csv": "csv", ".tsv": "csv", ".json": "json", ".jsonl": "json", ".parquet": "parquet"}


@dataclass(frozen=True)
class SplitHead:
    """A split's first rows, how many rows it has, and whether that count (and the rows) are complete."""

    rows: Dataset
    num_rows: int
    exact: bool


def data_locations(spec: JobSpec) -> list[str]:
    """Every ``data_files`` entry (patterns as written) and the ``data_dir`` of the spec."""
    ds = spec.dataset
    files = ds.data_files.values() if isinstance(ds.data_files, dict) else [ds.data_files]
    paths = [p for entry in files if entry is not None for p in ([entry] if isinstance(entry, str) else entry)]
    return paths + ([ds.data_dir] if ds.data_dir is not None else [])


def _fresh_listings(spec: JobSpec) -> DownloadConfig | None:
    """Listing options for the object stores the spec names: none cached. Other hosts write there, and
    fsspec's listings cache (per process, never expiring) would hide their files from a long-lived API."""
    protocols = {name.split("://", 1)[0] for name in data_locations(spec) if "://" in name}
    if not protocols:
        return None
    return DownloadConfig(storage_options={protocol: {"use_listings_cache": False} for protocol in protocols})


def split_files(spec: JobSpec) -> dict[str, list[str]]:
    """Each split's files, resolved as ``datasets.load_dataset`` resolves ``data_files``/``data_dir``."""
    ds = spec.dataset
    base = ds.data_dir or "."
    listing = _fresh_listings(spec)
    if ds.data_files is not None:
        patterns = sanitize_patterns(ds.data_files)
    elif ds.data_dir is not None:
        fs, folder = fsspec.core.url_to_fs(ds.data_dir, use_listings_cache=False)
        if not fs.isdir(folder):
            raise spec_error("dataset.data_dir", f"no folder {ds.data_dir}")
        try:
            patterns = get_data_patterns(base, download_config=listing)
        except EmptyDatasetError as exc:
            raise spec_error("dataset.data_dir", f"no data files in {ds.data_dir}") from exc
    else:
        raise spec_error("dataset.data_files", f"dataset.path {ds.path!r} needs `data_files` or `data_dir`")
    resolved: dict[str, list[str]] = {}
    for split, split_patterns in patterns.items():
        field = f"dataset.data_files.{split}" if isinstance(ds.data_files, dict) else "dataset.data_files"
        try:
            files = DataFilesDict.from_patterns({split: split_patterns}, base_path=base, download_config=listing)[split]
        except FileNotFoundError as exc:
            raise spec_error(field if ds.data_files is not None else "dataset.data_dir", str(exc)) from exc
        resolved[split] = [str(f) for f in files]
    return resolved


def _estimated_rows(path: str, size: int) -> int:
    with fsspec.open(path, "rb") as fh:
        sample = fh.read(_SAMPLE_BYTES)
    lines = max(sample.count(b"\n"), 1)
    return max(int(size * lines / max(len(sample), 1)) - 1, 1)


def _csv_head(path: str, size: int) -> tuple[pd.DataFrame, int, bool]:
    kwargs = {k: v for k, v in CsvConfig().pd_read_csv_kwargs.items() if k not in ("chunksize", "nrows")}
    if size <= HEAD_BYTES:
        frame = pd.read_csv(path, **kwargs)
        return frame, len(frame), True
    return pd.read_csv(path, nrows=HEAD_ROWS, **kwargs), _estimated_rows(path, size), False


def _json_head(path: str, size: int) -> tuple[list[dict[str, Any]], int, bool]:
    # compression="infer": .gz/.bz2/.xz/.zst files are read as the json builder reads them.
    with fsspec.open(path, "rb", compression="infer") as fh:
        text = fh.read(HEAD_BYTES + 1)
    whole = len(text) <= HEAD_BYTES
    if whole and text.lstrip()[:1] == b"[":
        rows = json.loads(text)
        return rows, len(rows), True
    lines = text.splitlines() if whole else text.splitlines()[:-1]  # the last line may be cut
    rows = [json.loads(line) for line in lines[: None if whole else HEAD_ROWS] if line.strip()]
    return rows, (len(rows) if whole else _estimated_rows(path, size)), whole


def head_dataset(table: pa.Table) -> Dataset:
    """A Dataset over rows in memory; a fixed fingerprint skips hashing them (nothing here is cached)."""
    return Dataset(InMemoryTable(table), fingerprint="preflight-head")


def read_head(fmt: str, path: str) -> tuple[Dataset, int, bool]:
    """One file's first rows as a Dataset, its (exact or estimated) row count, and whether it was read whole."""
    fs, fs_path = fsspec.core.url_to_fs(path)
    size = int(fs.size(fs_path))
    if fmt == "parquet":
        with fs.open(fs_path, "rb") as handle:
            parquet = pq.ParquetFile(handle)
            batch = next(parquet.iter_batches(batch_size=HEAD_ROWS), None)
            table = pa.Table.from_batches([batch]) if batch is not None else parquet.schema_arrow.empty_table()
            total = parquet.metadata.num_rows
        return head_dataset(table), total, total <= HEAD_ROWS
    if fmt == "json":
        rows, count, exact = _json_head(path, size)
        return head_dataset(pa.Table.from_pylist(rows)), count, exact
    frame, count, exact = _csv_head(path, size)
    return head_dataset(pa.Table.from_pandas(frame, preserve_index=False)), count, exact


def _folder_split(fmt: str, files: list[str]) -> SplitHead:
    extensions = set(FOLDER_EXTENSIONS[fmt])
    media = sorted(f for f in files if Path(f).suffix.lower() in extensions)
    labels = [Path(f).parent.name for f in media]
    rows = head_dataset(pa.table({FOLDER_COLUMNS[fmt]: media, "label": labels}))
    return SplitHead(rows=rows, num_rows=len(media), exact=True)


def data_format(spec: JobSpec, path: str) -> str:
    """The builder that reads ``path``: the spec's own, or the file suffix's for a generic one."""
    name = spec.dataset.path or ""
    return SUFFIX_FORMATS.get(Path(path).suffix.lower(), "csv") if name not in ("csv", "json", "parquet") else name


def peek_splits(spec: JobSpec) -> dict[str, SplitHead]:
    """Every split's head; raises SpecError naming the field when a file is missing or does not parse."""
    fmt = spec.dataset.path or ""
    heads: dict[str, SplitHead] = {}
    for split, files in split_files(spec).items():
        field = f"dataset.data_files.{split}" if isinstance(spec.dataset.data_files, dict) else "dataset.data_files"
        if fmt in FOLDER_EXTENSIONS:
            heads[split] = _folder_split(fmt, files)
            continue
        parts, total, exact = [], 0, True
        for path in files:
            try:
                rows, count, whole = read_head(data_format(spec, path), path)
            except (ValueError, OSError, UnicodeDecodeError) as exc:
                raise spec_error(field, f"cannot parse {path}: {str(exc).splitlines()[0]}") from exc
            parts.append(rows)
            total, exact = total + count, exact and whole
            if sum(len(p) for p in parts) >= HEAD_ROWS:
                exact = exact and path == files[-1]
                break
        tables = [p.data.table for p in parts]
        rows = parts[0] if len(parts) == 1 else head_dataset(pa.concat_tables(tables, promote_options="default"))
        heads[split] = SplitHead(rows=rows, num_rows=total, exact=exact)
    return heads
