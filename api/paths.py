"""What a job may read: local paths under the data root, hub ids, and public URLs; nothing else.

A job runs on a worker with the service's file system and network, so a spec must not name
``/etc/passwd``, ``../other-owner``, ``file://`` or an internal address. Rules, per string field
that can name a location (model and tokenizer paths, ``dataset.path``, ``data_files``, ``data_dir``):

- ``scheme://`` URLs: ``http(s)`` only to public addresses (checked after DNS resolution, by the rule
  in trainer_core/net_guard.py that the run applies again when it fetches), and the
  remote-storage schemes the `datasets` library reads (``hf``, ``s3``, ``gs``...); ``file://`` and
  anything else is refused.
- Absolute paths must lie under the data root; ``..`` is refused everywhere. Uploaded datasets live
  in ``<data root>/uploads/<owner>/``, and only their owner (or an admin) may name them. Patterns,
  folders and links are resolved as the loader reads them, and a path the file system refuses to look
  up is refused with its reason: the rule in trainer_core/path_guard.py, which the run applies again
  when it opens the paths.
- Relative local paths are taken relative to the data root and stored absolute, so the worker
  reads the same file whatever its working directory. A model or dataset name that looks like a
  hub id (``org/name``) is a hub id unless the data root holds a folder of that name.
- On an object-store data root (``DATA_ROOT=s3://bucket/prefix``) relative names become URLs under
  it, a URL of the store's own scheme must lie under it (the service reads it with its own
  credentials), local paths are refused, and uploads, patterns and folders follow the same rules.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fsspec import AbstractFileSystem

from api.problems import Problem
from service_core.datastore import DataCache, DataStore, FetchError, localize_models
from service_core.db.models import Dataset
from service_core.settings import Settings
from trainer_core.net_guard import host_problem
from trainer_core.path_guard import (
    MAX_MATCHES,
    REFUSED_IN_PATHS,
    UPLOADS_DIR,
    Reach,
    Roots,
    is_local_path,
    literal_base,
    os_problem,
    under,
)
from trainer_core.spec import BUILTIN_DATASET_BUILDERS, FieldError, JobSpec, SpecError

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
# Schemes `datasets`/fsspec read from remote storage with their own credentials: not the worker's network.
REMOTE_STORAGE_SCHEMES = frozenset({"hf", "s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})
HTTP_SCHEMES = frozenset({"http", "https"})
# "name" or "org/name": what the hub accepts as a model or dataset id.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
FOLDER_FORMATS = frozenset({"imagefolder", "audiofolder"})


class _Checker:
    """Collects every bad location in a spec so the user sees all of them in one answer."""

    def __init__(self, data_root: str | Path, owner: str | None):
        root = data_root.as_posix() if isinstance(data_root, Path) else data_root
        self.store = DataStore(posixpath.normpath(root) if "://" not in root else root)
        self.root = self.store.root
        self.uploads = f"{self.root}/{UPLOADS_DIR}"
        self.owner = owner
        self.reach = Reach(self.root, owner)
        if self.store.is_local:
            self.roots = self.reach.roots()
        else:  # URLs as they are: an object store has no links to resolve
            self.roots = Roots(self.root, self.uploads, None if owner is None else f"{self.uploads}/{owner}")
        self.errors: list[FieldError] = []

    def fail(self, field: str, message: str) -> None:
        self.errors.append(FieldError(field, message, "forbidden_location"))

    def location(self, value: str, field: str, *, hub_ok: bool, local_base: bool = True, tree: bool = False) -> str:
        """Check one location; returns it, with a relative local path made absolute under the root.

        ``tree``: the loader reads a local location recursively (``data_dir``, a dataset folder). An
        object-store root that does not answer is a 503 (its client raises many types of its own).
        """
        if self.store.is_local:
            return self._location(value, field, hub_ok=hub_ok, local_base=local_base, tree=tree)
        try:
            return self._location(value, field, hub_ok=hub_ok, local_base=local_base, tree=tree)
        except Exception as exc:
            what = f"the data store {self.root} did not answer ({type(exc).__name__}) while checking {field}"
            raise store_unavailable(what) from exc

    def _location(self, value: str, field: str, *, hub_ok: bool, local_base: bool, tree: bool) -> str:
        scheme = _SCHEME.match(value)
        if scheme and self.store.path_of(value) is not None:  # the data root's own object store
            return self._stored(value, field, tree)
        if scheme:
            return self._url(value, scheme.group(1).lower(), field)
        if ".." in value.replace("\\", "/").split("/"):
            self.fail(field, "`..` is not allowed in paths")
            return value
        if is_local_path(value):
            if not self.store.is_local:
                self.fail(field, f"local paths are not read here: name files relative to the data root {self.root}")
                return value
            self._local(value, field, tree)
            return value
        if not local_base:  # relative to a hub dataset repository, not to this machine
            return value
        local = posixpath.join(self.root, value)
        if self.store.is_local and (problem := os_problem(local)):  # before it is taken for a hub id
            self.fail(field, problem)
            return value
        # "org/name" is a hub id unless the data root holds a folder of that name (as transformers
        # itself prefers a local folder over the hub).
        if hub_ok and _HUB_ID.match(value) and not self.store.fs.exists(self.store.path_of(local) or local):
            return value
        if not self.store.is_local:
            return self._stored(local, field, tree)
        self._local(local, field, tree)
        return local

    def _local(self, path: str, field: str, tree: bool) -> None:
        # The rule the run applies again when it opens the path (trainer_core/path_guard.py).
        if problem := self.reach.problem(path, tree=tree, roots=self.roots):
            self.fail(field, problem)

    def _stored(self, value: str, field: str, tree: bool) -> str:
        """A URL on the data root's object store; returns it in its canonical form (the root's scheme)."""
        path = self.store.path_of(value)
        assert path is not None
        url = self.store.url(path)
        if ".." in value.split("://", 1)[1].split("/"):  # object keys are literal: `..` is no parent there
            self.fail(field, "`..` is not allowed in paths")
        elif not under(path, self.store.base):
            self.fail(field, f"URLs of this object store must be under the data root {self.root}")
        elif problem := store_problem(url, self.roots, self.store.fs, tree=tree):
            self.fail(field, problem)
        return url

    def _url(self, value: str, scheme: str, field: str) -> str:
        if scheme in REMOTE_STORAGE_SCHEMES:
            return value
        if scheme not in HTTP_SCHEMES:
            self.fail(field, f"`{scheme}://` is not allowed; use a path under the data root or an http(s) URL")
            return value
        problem = host_problem(urlsplit(value).hostname or "")
        if problem:
            self.fail(field, f"URL host {problem}")
        return value


def store_problem(url: str, roots: Roots, fs: AbstractFileSystem, *, tree: bool) -> str | None:
    """Why a ``url`` (maybe a pattern) under an object-store data root must not be read by this caller,
    or None. The local rule (trainer_core/path_guard.py) with the pattern expanded by the store's glob;
    ``roots`` hold URLs, and objects have no links, so the literal folder alone decides."""
    if REFUSED_IN_PATHS.search(url.split("://", 1)[-1]):
        return "braces, `::` and percent-encoded characters are not allowed in data paths"
    base, pattern = literal_base(url)
    if pattern or tree or fs.isdir(base):
        problem = roots.tree_readable(base)
    else:
        problem = roots.readable(base)
    if problem is not None or not pattern:
        return problem
    try:
        matches = fs.glob(url)
    except (ValueError, OSError) as exc:  # fsspec refuses e.g. `a**b`; the loader would fail too
        return f"not a valid pattern: {exc}"
    if len(matches) > MAX_MATCHES:
        return f"the pattern matches more than {MAX_MATCHES} files"
    return None


def _data_files(checker: _Checker, value: Any, field: str, local_base: bool) -> Any:
    if isinstance(value, str):
        return checker.location(value, field, hub_ok=False, local_base=local_base)
    if isinstance(value, list):
        return [_data_files(checker, v, f"{field}.{i}", local_base) for i, v in enumerate(value)]
    if isinstance(value, dict):
        return {k: _data_files(checker, v, f"{field}.{k}", local_base) for k, v in value.items()}
    return value


def check_spec_locations(spec: JobSpec, data_root: str | Path, owner: str | None = None) -> JobSpec:
    """The spec with its locations checked and made absolute; raises SpecError naming each bad field.

    ``data_root`` is a local folder or an object-store URL (``Settings.data_root_url``); ``owner``
    (None for an admin) may read only its own folder of the uploads area.
    """
    checker = _Checker(data_root, owner)
    doc = spec.model_dump(mode="json", exclude_unset=True)
    model = doc["model"]
    for key in ("name_or_path", "tokenizer", "processor"):
        if isinstance(model.get(key), str):
            # A folder on the store is fetched whole (service_core/datastore.py): checked as a tree.
            model[key] = checker.location(model[key], f"model.{key}", hub_ok=True, tree=not checker.store.is_local)
    dataset = doc["dataset"]
    builder = dataset.get("path") in BUILTIN_DATASET_BUILDERS
    if isinstance(dataset.get("path"), str) and not builder:
        dataset["path"] = checker.location(dataset["path"], "dataset.path", hub_ok=True, tree=True)
    # data files of a hub dataset are relative to its repository; of a builder, to this machine.
    local = builder or str(dataset.get("path", "")).startswith("/") or checker.store.contains(str(dataset.get("path")))
    if dataset.get("data_files") is not None:
        dataset["data_files"] = _data_files(checker, dataset["data_files"], "dataset.data_files", local)
    if isinstance(dataset.get("data_dir"), str):
        dataset["data_dir"] = checker.location(
            dataset["data_dir"], "dataset.data_dir", hub_ok=False, local_base=local, tree=True
        )
    if checker.errors:
        raise SpecError(checker.errors)
    return type(spec).model_validate(doc)


def resolve_uploaded_dataset(spec: JobSpec, dataset: Dataset, data_root: str | Path) -> JobSpec:
    """Replace ``{"dataset": {"id": ...}}`` by the uploaded files' builder and stored location."""
    given = spec.dataset.model_fields_set & {"data_files", "data_dir"}
    if given:
        field = sorted(given)[0]
        raise SpecError([FieldError(f"dataset.{field}", "an uploaded dataset brings its own files", "conflict")])
    doc = spec.model_dump(mode="json", exclude_unset=True)
    root = data_root.as_posix() if isinstance(data_root, Path) else data_root
    location = DataStore(root).location(dataset.storage_path)
    doc["dataset"].pop("id")
    doc["dataset"]["path"] = dataset.format
    if dataset.format in FOLDER_FORMATS:
        doc["dataset"]["data_dir"] = location
    else:
        doc["dataset"]["data_files"] = {"train": location}
    return type(spec).model_validate(doc)


def store_unavailable(detail: str) -> Problem:
    """The 503 of an object-store data root that did not answer: the client may retry."""
    return Problem(503, f"{detail}; nothing was stored, submit again later", headers={"Retry-After": "5"})


def store_root(settings: Settings) -> str | None:
    """The object-store data root whose data preflight reads there, or None for a local data root."""
    store = DataStore.of(settings)
    return None if store.is_local else store.root


def readable_here(spec: JobSpec, settings: Settings) -> JobSpec:
    """``spec`` as this API host's checks read it: model folders on an object-store data root replaced by
    this host's cached copies (preflight and the estimator need a folder); the stored spec keeps the URL.

    A folder that is not there is a 422 naming the field; a store that does not answer, a 503.
    """
    cache = DataCache.of(settings)
    if cache.store.is_local:
        return spec
    try:
        doc = localize_models(spec.model_dump(mode="json", exclude_unset=True), cache)
    except FetchError as exc:
        if not exc.missing:
            raise store_unavailable(str(exc)) from exc
        raise SpecError([FieldError(exc.field, exc.message, "not_found")]) from exc
    return type(spec).model_validate(doc)
