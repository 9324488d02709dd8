"""Raw data: load the dataset, choose the train and eval splits, check columns, map labels to ids."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import datasets
from datasets import Audio, ClassLabel, Dataset, DatasetDict, Features, Value
from datasets.exceptions import DatasetNotFoundError

from trainer_core.net_guard import guarded_resolution, host_problem
from trainer_core.spec import DatasetSpec, FieldError, JobSpec, SpecError, data_file_entries

logger = logging.getLogger(__name__)

# The column each task reads its input from (besides the label column).
INPUT_COLUMN_FIELDS: dict[str, tuple[str, ...]] = {
    "text-classification": ("text_column", "text_pair_column"),
    "image-classification": ("image_column",),
    "audio-classification": ("audio_column",),
}


def spec_error(field: str, message: str) -> SpecError:
    """A :class:`SpecError` about one field."""
    return SpecError([FieldError(field=field, message=message)])


def file_source(value: Any, field: str) -> str | io.BytesIO:
    """What a media column cell points at, ready to open: a path, or ``{bytes, path}`` as datasets
    stores Image/Audio features undecoded (bytes win: the path may only be the original name)."""
    if isinstance(value, Mapping) and value.get("bytes"):
        return io.BytesIO(value["bytes"])
    if isinstance(value, Mapping) and value.get("path"):
        return str(value["path"])
    if isinstance(value, str):
        return value
    raise spec_error(field, f"cannot read a file from a {type(value).__name__} value")


def _source_field(ds: DatasetSpec) -> str:
    if ds.data_files is not None:
        return "dataset.data_files"
    return "dataset.data_dir" if ds.data_dir is not None else "dataset.path"


def _urls(value: Any, field: str) -> Iterator[tuple[str, str]]:
    for where, location in data_file_entries(value, field):
        if location.lower().startswith(("http://", "https://")):
            yield location, where


def checked_url_hosts(ds: DatasetSpec) -> set[str]:
    """The hosts of the dataset's http(s) URLs, each resolved now and refused (SpecError naming the
    field) when it is or resolves to an internal address: the submit's check again, at fetch time."""
    hosts: set[str] = set()
    for key in ("path", "data_files", "data_dir"):
        for url, field in _urls(getattr(ds, key), f"dataset.{key}"):
            host = urlsplit(url).hostname or ""
            if problem := host_problem(host):
                raise spec_error(field, f"URL host {host} {problem} at fetch time: refused, nothing was requested")
            hosts.add(host)
    return hosts


def load_raw(spec: JobSpec) -> DatasetDict:
    """``datasets.load_dataset`` on the spec's path, data files, data dir and configuration name.

    ``audiofolder`` is read with its audio column as plain file paths: datasets' Audio feature needs
    torchcodec even to store a path, and :mod:`trainer_core.data.audio` decodes with soundfile instead.
    """
    ds = spec.dataset
    if ds.path is None:
        raise spec_error("dataset.id", "an uploaded dataset id must be resolved to a path before training")
    kwargs: dict[str, Any] = {"data_files": ds.data_files, "data_dir": ds.data_dir, "name": ds.name}
    if ds.path == "audiofolder":
        # Folder-per-class layout: the builder yields the file path and the folder name as label.
        kwargs["features"] = Features({"audio": Value("string"), "label": Value("string")})
        kwargs["drop_labels"] = False
    hosts = checked_url_hosts(ds)
    with guarded_resolution(hosts) as refused:
        try:
            loaded = datasets.load_dataset(ds.path, **{k: v for k, v in kwargs.items() if v is not None})
        except (FileNotFoundError, DatasetNotFoundError) as exc:
            raise spec_error(_source_field(ds), f"cannot load dataset {ds.path!r}: {exc}") from exc
        except Exception as exc:
            if refused:  # the fetching client's own resolution answered an internal address
                raise spec_error(_source_field(ds), f"URL host {refused[0]} at fetch time: refused") from exc
            raise
    if not isinstance(loaded, DatasetDict):
        raise spec_error("dataset.path", f"expected a dataset with splits, got {type(loaded).__name__}")
    if spec.task == "audio-classification":
        loaded = _undecoded_audio(loaded, ds.audio_column)
    return loaded


def _undecoded_audio(raw: DatasetDict, column: str) -> DatasetDict:
    """Audio features read as ``{bytes, path}``: decoding them would need torchcodec."""
    out = {}
    for split, data in raw.items():
        if isinstance(data.features.get(column), Audio):
            data = data.cast_column(column, Audio(decode=False))
        out[split] = data
    return DatasetDict(out)


def select_splits(spec: JobSpec, raw: DatasetDict) -> tuple[Dataset, Dataset | None]:
    """Train split and eval split by the rules: ``eval_split``, else ``validation`` or ``test``
    when present, else an ``eval_fraction`` hold-out of train (seeded by ``training.seed``), else none.
    """
    ds = spec.dataset
    splits = sorted(raw.keys())
    if ds.train_split not in raw:
        raise spec_error("dataset.train_split", f"no split {ds.train_split!r}; the dataset has {splits}")
    train = raw[ds.train_split]
    if ds.eval_split is not None:
        if ds.eval_split not in raw:
            raise spec_error("dataset.eval_split", f"no split {ds.eval_split!r}; the dataset has {splits}")
        return train, raw[ds.eval_split]
    for name in ("validation", "test"):
        if name in raw and name != ds.train_split:
            return train, raw[name]
    if ds.eval_fraction is not None:
        held_out = train.train_test_split(test_size=ds.eval_fraction, seed=spec.training.seed, shuffle=True)
        return held_out["train"], held_out["test"]
    return train, None


# causal-lm data comes in one of three shapes, told apart by which columns exist (first match wins).
LM_SHAPES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("chat", ("messages_column",)),
    ("prompt-completion", ("prompt_column", "completion_column")),
    ("text", ("text_column",)),
)


def lm_shape(ds: DatasetSpec, columns: list[str]) -> str:
    """Which causal-lm shape a split has: ``chat``, ``prompt-completion`` or ``text`` (see :data:`LM_SHAPES`).

    A prompt column without its completion column (or the reverse) is an error naming the missing one.
    """
    for shape, fields in LM_SHAPES:
        present = [f for f in fields if getattr(ds, f) in columns]
        if len(present) == len(fields):
            return shape
        if present:
            missing = next(f for f in fields if f not in present)
            raise spec_error(
                f"dataset.{missing}",
                f"column {getattr(ds, missing)!r} not found next to {getattr(ds, present[0])!r}; "
                f"its columns are: {', '.join(columns)}",
            )
    wanted = ", ".join(repr(getattr(ds, f)) for _, fields in LM_SHAPES for f in fields)
    raise spec_error(
        "dataset.text_column",
        f"causal-lm data needs a text, prompt/completion or messages column ({wanted}); "
        f"its columns are: {', '.join(columns)}",
    )


# What a preference job (method dpo/orpo) reads: every row a prompt with a chosen and a rejected answer.
PREFERENCE_FIELDS: tuple[str, ...] = ("prompt_column", "chosen_column", "rejected_column")


def _input_fields(spec: JobSpec, split: Dataset) -> tuple[str, ...]:
    if spec.is_preference:
        return PREFERENCE_FIELDS
    if spec.task == "causal-lm":
        shape = lm_shape(spec.dataset, split.column_names)
        return next(fields for name, fields in LM_SHAPES if name == shape)
    return (*INPUT_COLUMN_FIELDS[spec.task], "label_column")


def check_columns(spec: JobSpec, split: Dataset, split_name: str) -> None:
    """Every column the task reads must exist; the error names the spec field and the real columns."""
    for field in _input_fields(spec, split):
        column = getattr(spec.dataset, field)
        if column is not None and column not in split.column_names:
            raise spec_error(
                f"dataset.{field}",
                f"column {column!r} not found in the {split_name} split; "
                f"its columns are: {', '.join(split.column_names)}",
            )


@dataclass(frozen=True)
class LabelMapping:
    """Label names sorted (id = index) and how raw column values map to ids."""

    names: list[str]
    to_id: Mapping[Any, int]


def _label_values(split: Dataset, column: str, split_name: str) -> list[Any]:
    values = split[column][:]  # a list at once: iterating a datasets Column decodes row by row (~100x slower)
    if any(v is None for v in values):
        raise spec_error("dataset.label_column", f"the {split_name} split has rows with no label in {column!r}")
    return list(values)


def build_label_mapping(train: Dataset, eval_split: Dataset | None, column: str) -> LabelMapping:
    """Map labels to ids: ClassLabel columns keep their names; other values are sorted.

    Integer labels sort numerically (so ``10`` follows ``9``) and are named by their decimal form.
    A label that occurs in the eval split but never in train is an error: the model could not learn it.
    """
    feature = train.features[column]
    train_values = _label_values(train, column, "train")
    if isinstance(feature, ClassLabel):
        names = list(feature.names)
        to_id: dict[Any, int] = {i: i for i in sorted(set(train_values))}
    else:
        if any(isinstance(v, float) and not float(v).is_integer() for v in train_values):
            raise spec_error("dataset.label_column", f"{column!r} holds fractional numbers, not class labels")
        distinct = sorted(set(train_values))
        names = [str(int(v)) if isinstance(v, float) else str(v) for v in distinct]
        to_id = {value: i for i, value in enumerate(distinct)}
    if len(to_id) < 2:
        raise spec_error("dataset.label_column", f"{column!r} has fewer than 2 distinct labels in train")
    if eval_split is not None:
        unseen = sorted({v for v in _label_values(eval_split, column, "eval") if v not in to_id}, key=str)
        if unseen:
            shown = [names[v] if isinstance(feature, ClassLabel) else str(v) for v in unseen[:10]]
            raise spec_error(
                "dataset.label_column",
                f"the eval split has labels that never occur in train: {shown}",
            )
    return LabelMapping(names=names, to_id=to_id)
