"""The data root (``DATA_ROOT``), a local folder or an object-store prefix, and the per-host cache of it.

Locations are strings: absolute paths under a local root, URLs (``s3://bucket/prefix/...``) under a
store. Both go through fsspec (s3fs for ``s3://``, configured by the standard AWS variables only).

A worker never hands a store URL to a run (runs get no store credentials): :func:`localize_spec`
fetches every data file, data folder and model folder a spec names on the store into
``$TRAINJOBS_HOME/cache/data/<key>/`` and returns the spec with those local paths. The key is a hash
of the objects' names, ETags and sizes, so an object is fetched once per host, and a changed object
gets a new entry. Each fetch downloads into a temporary folder beside the cache and renames it into
place: fetches racing on one host never see (or leave) a half-written entry.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import posixpath
import shutil
import tempfile
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from service_core.settings import Settings
from service_core.status import ErrorReason
from trainer_core.path_guard import under

GLOB_CHARS = frozenset("*?[")
CACHE_DIR = Path("cache") / "data"


class DataStore:
    """``DATA_ROOT`` through fsspec: where relative names land, and which URLs lie under it."""

    def __init__(self, root: str):
        self.root = root.rstrip("/") or "/"
        self.is_local = "://" not in self.root
        if self.is_local:
            self.fs: fsspec.AbstractFileSystem = LocalFileSystem()
            self.base = self.root
            self.protocols: tuple[str, ...] = ()
        else:
            # No listings cache: other hosts write here too, and a stale listing would hide their files.
            self.fs, base = fsspec.core.url_to_fs(self.root, use_listings_cache=False)
            self.base = posixpath.normpath(base)
            protocol = self.fs.protocol
            self.protocols = (protocol,) if isinstance(protocol, str) else tuple(protocol)
            self.root = self.url(self.base)  # canonical: `s3a://b/p/` and `s3://b/p` are one root

    @classmethod
    def of(cls, settings: Settings) -> DataStore:
        return cls(settings.data_root_url)

    def location(self, relative: str) -> str:
        """The location of ``relative`` (a posix path under the root)."""
        return posixpath.join(self.root, relative)

    def path_of(self, location: str) -> str | None:
        """``location`` as a path of this store's file system (normalised), or None when it is not on it."""
        if self.is_local:
            return None if "://" in location else posixpath.normpath(location)
        protocol = location.split("://", 1)[0].lower() if "://" in location else ""
        if protocol not in self.protocols:
            return None
        return posixpath.normpath(self.fs._strip_protocol(location))

    def url(self, path: str) -> str:
        """The location of a path of this store's file system (inverse of :meth:`path_of`)."""
        return path if self.is_local else f"{self.protocols[0]}://{path}"

    def contains(self, location: str) -> bool:
        """Whether ``location`` is a URL under this (object-store) root."""
        path = None if self.is_local else self.path_of(location)
        return path is not None and under(path, self.base)

    def put_folder(self, local: Path, relative: str) -> None:
        """Copy a local folder's files under ``relative`` (a new prefix)."""
        target = posixpath.join(self.base, relative).rstrip("/")
        for file in sorted(p for p in local.rglob("*") if p.is_file()):
            self.fs.put_file(str(file), f"{target}/{file.relative_to(local).as_posix()}")

    def remove(self, relative: str) -> None:
        """Delete everything under ``relative``; nothing there is not an error."""
        target = f"{self.base}/{relative}"
        if self.fs.exists(target):
            self.fs.rm(target, recursive=True)


class FetchError(Exception):
    """A spec location on the store that cannot be fetched; names the field and the job's failure reason.

    ``missing``: the store answered that nothing is there (else it failed to answer: an outage).
    """

    def __init__(self, field: str, message: str, *, missing: bool = True):
        self.field, self.message, self.missing = field, message, missing
        self.reason = ErrorReason.model_error if field.startswith("model.") else ErrorReason.data_error
        super().__init__(f"{field}: {message}")


def _version(info: dict[str, Any]) -> str:
    """What changes when an object's content does: its ETag where the store gives one."""
    for key in ("ETag", "etag", "md5Hash", "LastModified", "mtime", "updated"):
        if info.get(key):
            return str(info[key])
    return ""


class DataCache:
    """This host's copies of store objects under ``folder``, one entry per object set and version."""

    def __init__(self, store: DataStore, folder: Path):
        self.store, self.folder = store, folder

    @classmethod
    def of(cls, settings: Settings) -> DataCache:
        return cls(DataStore.of(settings), settings.home.resolve() / CACHE_DIR)

    def fetch_file(self, location: str) -> Path:
        """The local copy of one object (fetched now unless this host has it)."""
        path = self._path(location)
        info = self.store.fs.info(path)
        if info.get("type") != "file":
            raise IsADirectoryError(f"{location} is a folder, not a file")
        name = posixpath.basename(path)
        return self._entry([(path, name, info)]) / name

    def fetch_folder(self, location: str) -> Path:
        """The local copy of every object under ``location`` (a model or dataset folder)."""
        path = self._path(location)
        found = self.store.fs.find(path, detail=True)
        files = []
        for full, info in sorted(found.items()):
            relative = posixpath.normpath(posixpath.relpath(full, path))
            if relative.startswith(("../", "/")) or relative in ("..", "."):
                continue  # a key that is not below the folder (or the folder's own marker)
            files.append((full, relative, info))
        if not files:
            raise FileNotFoundError(f"no folder {location} (no objects under it)")
        return self._entry(files)

    def _path(self, location: str) -> str:
        path = self.store.path_of(location)
        if path is None or not under(path, self.store.base):
            raise ValueError(f"{location} is not under the data root {self.store.root}")
        return path

    def _entry(self, files: list[tuple[str, str, dict[str, Any]]]) -> Path:
        key = hashlib.sha256(
            json.dumps([(rel, _version(info), info.get("size")) for _, rel, info in files]).encode()
        ).hexdigest()[:32]
        final = self.folder / key
        if final.is_dir():
            return final
        self.folder.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=self.folder))
        try:
            for remote, rel, info in files:
                dest = partial / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                self.store.fs.get_file(remote, str(dest))
                if info.get("size") is not None and dest.stat().st_size != int(info["size"]):
                    raise OSError(f"{self.store.url(remote)}: fetched {dest.stat().st_size} of {info['size']} bytes")
            try:
                os.rename(partial, final)
            except OSError:
                if not final.is_dir():  # not lost to a concurrent fetch of the same entry: a real error
                    raise
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        return final

    def fetch(self, location: str, field: str, *, folder: bool) -> str:
        """:meth:`fetch_folder` or :meth:`fetch_file` as a local path; any failure is a FetchError naming ``field``."""
        try:
            local = self.fetch_folder(location) if folder else self.fetch_file(location)
        except FileNotFoundError as exc:
            raise FetchError(field, f"{location} is not on the data root ({exc})") from exc
        except Exception as exc:  # any client error of the store (network, permissions, throttling)
            raise FetchError(field, f"fetching {location} failed: {type(exc).__name__}: {exc}", missing=False) from exc
        return str(local)

    def fetch_files(self, location: str, field: str) -> list[str]:
        """A data-files entry: one file, or every file a pattern matches on the store (as the loader would)."""
        if not GLOB_CHARS & set(location):
            return [self.fetch(location, field, folder=False)]
        try:
            matches = sorted(self.store.fs.glob(self._path(location)))
        except Exception as exc:  # as in fetch: the store's client errors
            message = f"expanding {location} failed: {type(exc).__name__}: {exc}"
            raise FetchError(field, message, missing=False) from exc
        if not matches:
            raise FetchError(field, f"{location} matches no files on the data root")
        return [self.fetch(self.store.url(match), field, folder=False) for match in matches]


def _localize_files(cache: DataCache, value: Any, field: str) -> Any:
    if isinstance(value, str) and cache.store.contains(value):
        files = cache.fetch_files(value, field)
        return files[0] if len(files) == 1 and not GLOB_CHARS & set(value) else files
    if isinstance(value, list):
        out: list[Any] = []
        for i, item in enumerate(value):
            local = _localize_files(cache, item, f"{field}.{i}")
            out.extend(local if isinstance(local, list) and not isinstance(item, list) else [local])
        return out
    if isinstance(value, dict):
        return {key: _localize_files(cache, item, f"{field}.{key}") for key, item in value.items()}
    return value


def localize_models(spec: dict[str, Any], cache: DataCache) -> dict[str, Any]:
    """A copy of ``spec`` with its model, tokenizer and processor folders on the store replaced by
    ``cache``'s copies (the API's preflight and estimator read those; a run loads them)."""
    doc = copy.deepcopy(spec)
    model = doc.get("model") or {}
    for key in ("name_or_path", "tokenizer", "processor"):
        if isinstance(model.get(key), str) and cache.store.contains(model[key]):
            model[key] = cache.fetch(model[key], f"model.{key}", folder=True)
    return doc


def localize_spec(spec: dict[str, Any], settings: Settings) -> dict[str, Any]:
    """``spec`` with every data file, data folder and model folder it names on the store replaced by
    this host's cached copy (fetched now when missing); raises :class:`FetchError` naming the field.

    A local ``DATA_ROOT`` has nothing to fetch: the spec comes back as it is.
    """
    cache = DataCache.of(settings)
    if cache.store.is_local:
        return spec
    doc = localize_models(spec, cache)
    dataset = doc.get("dataset") or {}
    for key in ("path", "data_dir"):
        if isinstance(dataset.get(key), str) and cache.store.contains(dataset[key]):
            dataset[key] = cache.fetch(dataset[key], f"dataset.{key}", folder=True)
    if dataset.get("data_files") is not None:
        dataset["data_files"] = _localize_files(cache, dataset["data_files"], "dataset.data_files")
    return doc
