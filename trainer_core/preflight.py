"""Preflight: what can be checked about a spec before any GPU is spent, in bounded time.

Data is read through :mod:`trainer_core.data.peek` (a few MB at most) and checked with the run's own
rules (:func:`~trainer_core.data.loading.select_splits`, ``check_columns``, ``build_label_mapping``,
the image and audio decoders), so a spec that passes here fails later only for what a head cannot
show. Models, tokenizers and processors are located (local folder, hub cache, or, when online, the
hub with one short request) and their config is checked against the task's model class.

Data on the service's own object store (``store_root``, an object-store ``DATA_ROOT``) is read there,
a head at a time, like local data; other remote data (http, hub, other buckets) is left to the run.
Model folders must be local: the API hands preflight its cached copy of one on the store.

Every problem found is collected and raised as one :class:`PreflightError` naming each field.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Hashable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import fsspec
from datasets import Dataset, DatasetDict

from trainer_core.data.loading import build_label_mapping, check_columns, select_splits
from trainer_core.data.peek import FOLDER_EXTENSIONS, SplitHead, data_locations, peek_splits
from trainer_core.lm_preflight import lm_errors, readable_tokenizer
from trainer_core.locate import check_model_sources
from trainer_core.spec import BUILTIN_DATASET_BUILDERS, FieldError, JobSpec, SpecError

logger = logging.getLogger(__name__)

MEDIA_SAMPLES = 4  # image/audio cells decoded per split


@dataclass
class PreflightReport:
    """What preflight checked and found: splits with row counts, the label set, model sources."""

    checks: list[str] = field(default_factory=list)
    splits: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The rows the run trains and evaluates on (after an eval_fraction hold-out), as counted above:
    # what the time estimate's steps and samples follow (trainer_core/flops.py).
    train_rows: int | None = None
    eval_rows: int | None = None
    # Positions a training sample occupies after padding or packing, from the rows read
    # (trainer_core/token_lengths.py): the time estimate's sequence length; None where not measured.
    sample_tokens: dict[str, Any] | None = None
    # Preference pairs (dpo/orpo) among the rows read: how many truncation cuts or drops
    # (trainer_core.data.preference.TruncationCounts); None for other jobs or an unreadable tokenizer.
    truncation: dict[str, int] | None = None
    labels: list[str] | None = None
    labels_complete: bool = False
    columns: list[str] = field(default_factory=list)
    model: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class PreflightError(SpecError):
    """A spec that preflight shows cannot run; ``report`` holds what was checked before."""

    def __init__(self, errors: list[FieldError], report: PreflightReport):
        self.report = report
        super().__init__(errors)


def preflight(spec: JobSpec, store_root: str | None = None) -> PreflightReport:
    """Check ``spec``'s data and model without training; raises :class:`PreflightError` on any problem.

    Locations must already be final (absolute, or relative to the working directory). Data URLs under
    ``store_root`` are read from the store; other remote data is not read.
    """
    report = PreflightReport()
    errors: list[FieldError] = []
    try:
        _check_data(spec, report, store_root)
    except SpecError as exc:
        errors.extend(exc.errors)
    errors.extend(check_model_sources(spec, report.model, report.checks))
    if not errors:
        errors.extend(lm_errors(spec, report.columns, report.checks))
    if errors:
        raise PreflightError(errors, report)
    return report


# Characters that make a data_files entry a pattern: its files can change without any stat showing it.
_PATTERN_CHARS = frozenset("*?[{")


def _file_stamp(path: Path) -> tuple[str, int, int, int]:
    stat = path.stat()
    return str(path), stat.st_size, stat.st_mtime_ns, stat.st_ino


def _object_stamp(url: str) -> tuple[str, int, str]:
    """An object's size and ETag (its content's version), read fresh from the store."""
    fs, path = fsspec.core.url_to_fs(url, use_listings_cache=False)
    info = fs.info(path)
    return url, int(info.get("size") or 0), str(info.get("ETag") or info.get("LastModified") or "")


def on_store(location: str, store_root: str | None) -> bool:
    """Whether ``location`` is a URL under the object-store root ``store_root``."""
    if store_root is None or "://" not in store_root:
        return False
    return location == store_root or location.startswith(store_root.rstrip("/") + "/")


def _left_to_run(spec: JobSpec, store_root: str | None) -> bool:
    """Whether the data is remote beyond the service's own store (read by the run only)."""
    return any("://" in p and not on_store(p, store_root) for p in data_locations(spec))


def _data_stamps(spec: JobSpec, store_root: str | None) -> tuple[Hashable, ...] | None:
    """Stat of every file preflight reads for the data; None when a stat cannot tell (patterns, folders)."""
    ds = spec.dataset
    if ds.path not in BUILTIN_DATASET_BUILDERS or _left_to_run(spec, store_root):
        return ()  # not read before the run (see _check_data): nothing on disk to depend on
    if ds.data_dir is not None or ds.data_files is None or ds.path in FOLDER_EXTENSIONS:
        return None
    paths = data_locations(spec)
    if any(_PATTERN_CHARS & set(p) for p in paths):
        return None
    return tuple(_object_stamp(p) if "://" in p else _file_stamp(Path(p)) for p in paths)


def _model_stamps(spec: JobSpec) -> tuple[Hashable, ...] | None:
    """Stat of the local model/tokenizer folders' files; None for a hub id (the cache may change)."""
    sources = [s for s in (spec.model.name_or_path, spec.model.tokenizer, spec.model.processor) if s is not None]
    stamps: list[Hashable] = []
    for source in sources:
        folder = Path(source).expanduser()
        if not source.startswith(("/", ".", "~")) or not folder.is_dir():
            return None
        stamps.append(_file_stamp(folder))  # a file added or removed changes the folder's mtime
        stamps.extend(_file_stamp(f) for f in sorted(folder.iterdir()) if f.is_file())
    return tuple(stamps)


def preflight_key(spec: JobSpec, store_root: str | None = None) -> Hashable | None:
    """What :func:`preflight`'s answer for ``spec`` depends on, or None when that cannot be told cheaply.

    The spec parts it reads (task, dataset, model) and the size, mtime and inode of every local file
    it would read (an object's size and ETag on the store ``store_root``): equal keys mean an equal
    answer, so a caller may reuse a passing report. A file
    that changed, appeared or went away changes the key; globs, folders and hub ids give None.
    A named file that is missing gives None too (preflight itself then says which).
    """
    try:
        data, model = _data_stamps(spec, store_root), _model_stamps(spec)
    except OSError:
        return None
    if data is None or model is None:
        return None
    parts = spec.model_dump_json(include={"task", "dataset", "model"})
    return parts, data, model, os.environ.get("HF_HUB_OFFLINE", "")


def _check_data(spec: JobSpec, report: PreflightReport, store_root: str | None) -> None:
    if spec.dataset.path not in BUILTIN_DATASET_BUILDERS:
        report.notes.append(f"hub dataset {spec.dataset.path!r}: not read before the run")
        return
    if _left_to_run(spec, store_root):
        # Remote files (http, hf, other buckets) are fetched by the run; preflight reads only the
        # service's own store, never with its credentials on a user's behalf elsewhere.
        report.notes.append("remote data files: not read before the run")
        return
    heads = peek_splits(spec)
    report.checks.append("data_files")
    for name, head in heads.items():
        report.splits[name] = {"rows": head.num_rows, "exact": head.exact}
    train, eval_split = _chosen_splits(spec, heads, report)
    report.columns = list(train.rows.column_names)
    check_columns(spec, train.rows, "train")
    if eval_split is not None:
        check_columns(spec, eval_split.rows, "eval")
    report.checks.append("columns")
    report.sample_tokens = _sample_tokens(spec, train.rows)
    if spec.is_preference:
        _check_pairs(spec, train.rows, report)
    if spec.task == "causal-lm":  # a language model's targets are its text: no label column
        return
    _check_labels(spec, train, eval_split, report)
    if spec.task != "text-classification":
        _check_media(spec, train.rows, "train")
        if eval_split is not None:
            _check_media(spec, eval_split.rows, "eval")
        report.checks.append("media_decodes")


def _check_pairs(spec: JobSpec, rows: Any, report: PreflightReport) -> None:
    """Preference pairs encoded as the run encodes them: a chat prompt needs a chat template (a
    SpecError on ``model.tokenizer``), and the report counts the pairs truncation cuts or drops."""
    from trainer_core.data.preference import count_truncation
    from trainer_core.data.preprocess import effective_max_length

    if (tokenizer := readable_tokenizer(spec)) is None:
        return
    counts = count_truncation(spec, tokenizer, rows[:], effective_max_length(spec, tokenizer))
    report.truncation = counts.as_dict()
    report.checks.append("preference_pairs")
    if counts.truncated:
        report.notes.append(
            f"{counts.truncated} of {counts.rows} pairs read lose tokens to truncation ({counts.prompt_cut} in the "
            f"prompt, {counts.answer_cut} in an answer; max_length {spec.preprocessing.max_length})"
        )


def _sample_tokens(spec: JobSpec, rows: Any) -> dict[str, Any] | None:
    """The rows' measured tokens a sample; None when they cannot be measured here (the model checks
    that follow say why, if it is the tokenizer): an estimate never fails a preflight."""
    from trainer_core.token_lengths import estimate_sample_tokens

    try:
        measured = estimate_sample_tokens(spec, rows)
    except Exception:
        logger.info("no token lengths for %r", spec.name, exc_info=True)
        return None
    return measured.as_dict() if measured is not None else None


def _chosen_splits(
    spec: JobSpec, heads: dict[str, SplitHead], report: PreflightReport
) -> tuple[SplitHead, SplitHead | None]:
    """Train and eval as the run picks them, each with at least one row.

    The run's own :func:`select_splits` names the splits; an ``eval_fraction`` hold-out is counted
    here rather than drawn (it is a random part of train: its rows and columns are train's).
    """
    ds = spec.dataset
    raw = DatasetDict({name: head.rows for name, head in heads.items()})
    no_holdout = spec.model_copy(update={"dataset": ds.model_copy(update={"eval_fraction": None})})
    _, eval_rows = select_splits(no_holdout, raw)
    train = heads[ds.train_split]
    if train.num_rows < 1:
        raise SpecError([FieldError("dataset.train_split", f"the {ds.train_split!r} split has no rows")])
    report.checks.append("splits")
    if eval_rows is None and ds.eval_fraction is not None:
        held = math.ceil(ds.eval_fraction * train.num_rows)
        if train.num_rows - held < 1:
            message = f"holding out {ds.eval_fraction:g} of {train.num_rows} rows leaves none to train on"
            raise SpecError([FieldError("dataset.eval_fraction", message)])
        report.splits["eval_fraction"] = {"rows": held, "exact": train.exact}
        report.splits[ds.train_split] = {"rows": train.num_rows - held, "exact": train.exact}
        report.train_rows, report.eval_rows = train.num_rows - held, held
        return train, None
    report.train_rows, report.eval_rows = train.num_rows, 0
    if eval_rows is None:
        # The run would never evaluate: never stop early, never know a best checkpoint.
        wants = {"early_stopping": spec.early_stopping is not None,
                 "training.load_best_model_at_end": spec.training.load_best_model_at_end}  # fmt: skip
        needs_eval = [field for field, on in wants.items() if on]
        if needs_eval:
            message = "needs an eval split: set dataset.eval_split or dataset.eval_fraction, or name one in data_files"
            raise SpecError([FieldError(field, message) for field in needs_eval])
        return train, None
    name = next(n for n, h in heads.items() if h.rows is eval_rows)
    if heads[name].num_rows < 1:
        where = "dataset.eval_split" if ds.eval_split is not None else f"dataset.data_files.{name}"
        raise SpecError([FieldError(where, f"the {name!r} split has no rows to evaluate on")])
    report.eval_rows = heads[name].num_rows
    return train, heads[name]


def _check_labels(spec: JobSpec, train: SplitHead, eval_split: SplitHead | None, report: PreflightReport) -> None:
    column = spec.dataset.label_column
    seen = {v for v in train.rows.data.column(column).to_pylist() if v is not None}
    if not train.exact and len(seen) < 2:
        # Only the head was read: a file sorted by label may still hold others further down.
        report.notes.append(f"only {len(seen)} label(s) in the first {len(train.rows)} train rows")
        return
    # Eval labels unseen in train are an error only when all of train was read.
    eval_rows = eval_split.rows if eval_split is not None and train.exact else None
    mapping = build_label_mapping(train.rows, eval_rows, column)
    report.labels = mapping.names
    report.labels_complete = train.exact
    report.checks.append("labels")


def _check_media(spec: JobSpec, rows: Dataset, split_name: str) -> None:
    """Decode a few cells with the run's own decoders, so a folder of non-images fails now."""
    from trainer_core.data.audio import read_audio
    from trainer_core.data.image import to_rgb

    image = spec.task == "image-classification"
    column = spec.dataset.image_column if image else spec.dataset.audio_column
    field_name = "dataset.image_column" if image else "dataset.audio_column"
    if spec.dataset.path in FOLDER_EXTENSIONS:
        field_name = "dataset.data_dir"
    if len(rows) == 0:
        raise SpecError([FieldError(field_name, f"the {split_name} split holds no {column} files")])
    for value in rows[column][:MEDIA_SAMPLES]:
        try:
            if isinstance(value, str) and "://" in value:  # a file of a folder on the data root's store
                with fsspec.open(value, "rb") as handle:
                    value = {"path": value, "bytes": handle.read()}
            to_rgb(value) if image else read_audio(value)
        except SpecError:
            raise
        except Exception as exc:  # PIL and soundfile raise many types for a file they cannot decode
            name = value.get("path") if isinstance(value, dict) else value
            kind = "an image" if image else "audio"
            message = f"cannot decode {name!r} as {kind} ({type(exc).__name__}: {str(exc).splitlines()[0]})"
            raise SpecError([FieldError(field_name, message)]) from exc


__all__ = ["PreflightError", "PreflightReport", "preflight", "preflight_key"]
