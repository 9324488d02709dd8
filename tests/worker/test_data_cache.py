"""The host's cache of an object-store data root (real SeaweedFS): a spec's store data and model folders
are fetched once per host, concurrent fetches agree, a changed object is fetched anew, and a fetch that
fails ends the job failed naming the field (through the worker's own execute_job)."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from service_core.datastore import CACHE_DIR, DataStore, FetchError, localize_spec
from service_core.db import Base
from service_core.db.session import get_engine
from service_core.settings import Settings
from service_core.status import ErrorReason
from worker.execute import execute_job

from .conftest import JobFactory, load_job, make_settings

FILES = {
    "data/train.csv": b"text,label\ngood,1\nbad,0\n",
    "data/validation.csv": b"text,label\nfine,1\n",
    "models/tiny/config.json": b'{"model_type": "bert"}',
    "models/tiny/sub/vocab.txt": b"[PAD]\n[UNK]\n",
}


@pytest.fixture
def settings(tmp_path: Path, s3_root: str) -> Settings:
    (tmp_path / "var").mkdir()
    settings = make_settings(tmp_path / "var", DATA_ROOT=s3_root)
    store = DataStore.of(settings)
    for name, content in FILES.items():
        store.fs.pipe_file(f"{store.base}/{name}", content)
    return settings


def store_spec(root: str) -> dict[str, Any]:
    return {
        "task": "text-classification",
        "model": {"name_or_path": f"{root}/models/tiny", "tokenizer": "bert-base-uncased"},
        "dataset": {
            "path": "csv",
            "data_files": {"train": f"{root}/data/train.csv", "validation": [f"{root}/data/valid*.csv"]},
        },
    }


def stamps(spec: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """(inode, mtime) of every local file the spec names: a re-download would change them."""
    files = [Path(spec["dataset"]["data_files"]["train"]), *map(Path, spec["dataset"]["data_files"]["validation"])]
    files += [p for p in Path(spec["model"]["name_or_path"]).rglob("*") if p.is_file()]
    return {str(f): (f.stat().st_ino, f.stat().st_mtime_ns) for f in files}


def cache_entries(settings: Settings) -> list[str]:
    return sorted(p.name for p in (settings.home.resolve() / CACHE_DIR).iterdir())


def test_store_data_and_models_are_fetched_once_per_host(settings: Settings) -> None:
    root = settings.data_root_url
    spec = store_spec(root)
    local = localize_spec(spec, settings)
    assert spec == store_spec(root)  # the job's own spec is left as it is
    model = Path(local["model"]["name_or_path"])
    assert (model / "config.json").read_bytes() == FILES["models/tiny/config.json"]
    assert (model / "sub" / "vocab.txt").read_bytes() == FILES["models/tiny/sub/vocab.txt"]
    assert local["model"]["tokenizer"] == "bert-base-uncased"  # a hub id is not the store's
    files = local["dataset"]["data_files"]
    assert Path(files["train"]).read_bytes() == FILES["data/train.csv"]
    # The pattern, expanded on the store into the files it matches.
    assert [Path(f).read_bytes() for f in files["validation"]] == [FILES["data/validation.csv"]]
    first = stamps(local)
    entries = cache_entries(settings)
    assert len(entries) == 3 and not any(name.startswith(".") for name in entries)  # no half-written entry left

    again = localize_spec(spec, settings)
    assert again == local and stamps(again) == first  # nothing fetched again
    assert cache_entries(settings) == entries

    store = DataStore.of(settings)
    store.fs.pipe_file(f"{store.base}/data/train.csv", b"text,label\nchanged,1\n")
    changed = localize_spec(spec, settings)
    assert changed["dataset"]["data_files"]["train"] != local["dataset"]["data_files"]["train"]
    assert Path(changed["dataset"]["data_files"]["train"]).read_bytes() == b"text,label\nchanged,1\n"
    assert changed["model"] == local["model"]


def test_concurrent_fetches_on_one_host_agree(settings: Settings) -> None:
    spec = store_spec(settings.data_root_url)
    start = threading.Barrier(4)
    results: list[dict[str, Any]] = []

    def fetch() -> None:
        start.wait()
        results.append(localize_spec(spec, settings))

    threads = [threading.Thread(target=fetch) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(results) == 4 and all(result == results[0] for result in results)
    model = Path(results[0]["model"]["name_or_path"])
    assert (model / "sub" / "vocab.txt").read_bytes() == FILES["models/tiny/sub/vocab.txt"]
    assert len(cache_entries(settings)) == 3  # the losers' downloads were removed


@pytest.mark.parametrize(
    ("change", "field", "reason"),
    [
        ({"dataset": {"path": "csv", "data_files": {"train": "data/nope.csv"}}}, "dataset.data_files.train",
         ErrorReason.data_error),
        ({"dataset": {"path": "csv", "data_files": ["data/*.parquet"]}}, "dataset.data_files.0",
         ErrorReason.data_error),
        ({"model": {"name_or_path": "models/none"}}, "model.name_or_path", ErrorReason.model_error),
    ],
)  # fmt: skip
def test_what_cannot_be_fetched_is_an_error_naming_the_field(
    settings: Settings, change: dict[str, Any], field: str, reason: ErrorReason
) -> None:
    root = settings.data_root_url
    spec = {**store_spec(root), **change}
    if "dataset" in change:  # relative names, as the API stores them: made URLs under the root
        data_files = change["dataset"]["data_files"]
        spec["dataset"] = {"path": "csv", "data_files": (
            {k: f"{root}/{v}" for k, v in data_files.items()} if isinstance(data_files, dict)
            else [f"{root}/{v}" for v in data_files]
        )}  # fmt: skip
    else:
        spec["model"] = {"name_or_path": f"{root}/{change['model']['name_or_path']}"}
    with pytest.raises(FetchError) as caught:
        localize_spec(spec, settings)
    assert caught.value.field == field and caught.value.reason == reason
    assert str(caught.value).startswith(f"{field}: ")


def test_a_local_data_root_has_nothing_to_fetch(tmp_path: Path) -> None:
    settings = make_settings(tmp_path / "var")
    spec = store_spec(settings.data_root_url)
    assert localize_spec(spec, settings) is spec


def test_a_job_whose_data_cannot_be_fetched_fails_naming_the_field(settings: Settings, make_job: JobFactory) -> None:
    Base.metadata.create_all(get_engine(settings.database_url))
    root = settings.data_root_url
    spec = {**store_spec(root), "dataset": {"path": "csv", "data_files": {"train": f"{root}/data/gone.csv"}}}
    job_id = make_job(settings, spec)
    assert execute_job(job_id, settings) == "failed"
    job = load_job(settings, job_id)
    assert job.error_reason == ErrorReason.data_error
    assert "dataset.data_files.train" in (job.error_message or "") and "data/gone.csv" in (job.error_message or "")
    get_engine(settings.database_url).dispose()
