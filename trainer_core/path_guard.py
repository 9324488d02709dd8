"""Which local paths a job may read: under the data root, and of the uploads only its owner's. The one
rule for the API's check at submit (api/paths.py) and the run's check when it opens them
(:func:`check_reach`): the local twin of trainer_core/net_guard.py.

Paths are read as the `datasets` loader reads them: it expands ``*``, ``**``, ``?`` and ``[..]`` in
``data_files`` (fsspec glob) and reads a ``data_dir`` or a local dataset folder recursively, so a
prefix check on the written path is not enough (``upload[s]/bob/*/x.csv`` or ``**/x.csv`` names no
upload folder yet reaches one). The part of a path before its first pattern character (its literal
folder) is resolved with ``realpath``; a pattern or a folder read is allowed only when that folder
cannot contain other owners' uploads, and every file the pattern matches now is resolved and checked
too (links). Braces and percent-encoded characters are refused outright: no loader needs them, and a
checker that guessed their meaning wrong would be a hole. A path the OS refuses to look up (a part
longer than the file system allows, a loop of links, a file where a folder should be) is refused
with the OS's reason rather than left to fail deep inside a loader.

A job is checked when it is submitted and read when its run starts, maybe hours later. A file
swapped for a link in between (on a shared mount, or a link into another owner's upload) would be
read from wherever the link points, so the run applies the same rule again to every local path it
opens (data files, folders walked recursively, models, tokenizers, processors) and refuses with the
field's failure (``data_error``, ``model_error``) before reading any of them.
"""

from __future__ import annotations

import argparse
import errno
import os
import posixpath
import re
from collections.abc import Iterator
from dataclasses import dataclass

from trainer_core.spec import FieldError, JobSpec, SpecError, data_file_entries

UPLOADS_DIR = "uploads"  # <data root>/uploads/<owner>/<dataset id>/: where the API stores uploads
GLOB_CHARS = frozenset("*?[]")
REFUSED_IN_PATHS = re.compile(r"[{}]|%[0-9A-Fa-f]{2}|::")
_DRIVE = re.compile(r"^[A-Za-z]:[\\/]")
# A pattern matching (or a folder holding) more entries than this is refused rather than checked
# entry by entry; uploads are exempt (they hold no links to check).
MAX_MATCHES = 100_000
# The spec's model fields that name a location (a hub id, or a local folder).
MODEL_FIELDS = ("name_or_path", "tokenizer", "processor")


def under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def is_local_path(value: str) -> bool:
    """A location this machine's file system resolves as written: absolute, home-relative or a drive."""
    return value.startswith(("/", "~", "\\")) or bool(_DRIVE.match(value))


@dataclass(frozen=True)
class Roots:
    """Real (link-free) data root and uploads folder, and the caller's own uploads folder (None: admin)."""

    root: str
    uploads: str
    own: str | None

    @classmethod
    def of(cls, root: str, uploads: str, owner: str | None) -> Roots:
        real_uploads = os.path.realpath(uploads)
        return cls(os.path.realpath(root), real_uploads, None if owner is None else f"{real_uploads}/{owner}")

    def readable(self, real: str) -> str | None:
        """Why the caller may not read the real path ``real``, or None."""
        if not under(real, self.root):
            return f"resolves outside the data root {self.root}"
        if self.own is not None and under(real, self.uploads) and not under(real, self.own):
            return "this path is another owner's upload; use your own datasets"
        return None

    def tree_readable(self, real: str) -> str | None:
        """Why the caller may not read everything below ``real`` (a folder or a pattern's base)."""
        problem = self.readable(real)
        if problem is None and self.own is not None and under(self.uploads, real):
            return "a pattern or folder here would reach other owners' uploads; name a folder of your own"
        return problem


@dataclass(frozen=True)
class Reach:
    """What one job may read on a local data root: everything under ``root`` except other owners'
    uploads (``owner`` None: an admin's job, which may read every upload)."""

    root: str
    owner: str | None = None

    @property
    def uploads(self) -> str:
        return f"{self.root}/{UPLOADS_DIR}"

    def roots(self) -> Roots:
        return Roots.of(self.root, self.uploads, self.owner)

    def problem(self, path: str, *, tree: bool, roots: Roots | None = None) -> str | None:
        """Why the job may not read the local ``path`` (absolute, maybe a pattern): as written, then as
        the loader would resolve it (``roots``: this reach's, resolved once by a caller checking many)."""
        norm = posixpath.normpath(path)
        if not under(norm, self.root):
            return f"local paths must be under the data root {self.root}"
        if self.owner is not None and under(norm, self.uploads) and not under(norm, f"{self.uploads}/{self.owner}"):
            return "this path is another owner's upload; use your own datasets"
        return local_problem(norm, roots or self.roots(), tree=tree)

    def args(self) -> list[str]:
        """The run's command-line options that give it this reach (:func:`add_reach_arguments`)."""
        return ["--data-root", self.root, *(["--owner", self.owner] if self.owner is not None else [])]


def add_reach_arguments(parser: argparse.ArgumentParser) -> None:
    """``--data-root`` and ``--owner``: a run that may read local paths only within that :class:`Reach`
    (the service's runs; a run without them reads what its user can)."""
    parser.add_argument("--data-root", help="refuse local paths outside this folder, as the service does")
    parser.add_argument("--owner", help="with --data-root: of the uploads there, read only this owner's")


def reach_from(args: argparse.Namespace) -> Reach | None:
    """The reach :func:`add_reach_arguments` gave, or None."""
    if args.owner is not None and args.data_root is None:
        raise SystemExit("--owner needs --data-root")
    return None if args.data_root is None else Reach(posixpath.normpath(args.data_root), args.owner)


def literal_base(path: str) -> tuple[str, bool]:
    """The folder before the first pattern character of an absolute ``path``, and whether it has one."""
    parts = path.split("/")
    for i, part in enumerate(parts):
        if GLOB_CHARS & set(part):
            return "/".join(parts[:i]) or "/", True
    return path, False


def os_problem(path: str) -> str | None:
    """Why the OS refuses to look ``path`` up (a name too long, a loop of links, a file where a folder
    should be...), or None. A path that does not exist is None: the loader reports it by name."""
    try:
        os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        code = errno.errorcode.get(exc.errno or 0, "an OS error")
        return f"the file system refuses this path: {exc.strerror or exc} ({code})"
    return None


def local_problem(path: str, roots: Roots, *, tree: bool) -> str | None:
    """Why an absolute local ``path`` (maybe a pattern) must not be read by this caller, or None.

    ``tree``: the loader reads the location recursively (``data_dir``, a local dataset folder).
    """
    if REFUSED_IN_PATHS.search(path):
        return "braces, `::` and percent-encoded characters are not allowed in local paths"
    base, pattern = literal_base(path)
    if problem := os_problem(base):
        return problem
    real_base = os.path.realpath(base)
    if pattern or tree or os.path.isdir(real_base):
        problem = roots.tree_readable(real_base)
    else:
        problem = roots.readable(real_base)
    if problem is not None:
        return problem
    if under(real_base, roots.uploads):
        return None  # uploads hold no links (api/uploads.py refuses them): nothing more to resolve
    if not pattern:
        return _links_problem(real_base, roots) if os.path.isdir(real_base) else None
    # Imported here: the CLI's parser (the lean client's `trainjobs`) takes this module's arguments.
    from fsspec.implementations.local import LocalFileSystem

    try:
        matches = LocalFileSystem().glob(path)
    except (ValueError, OSError) as exc:  # fsspec refuses e.g. `a**b`; the loader would fail too
        return f"not a valid pattern: {exc}"
    if len(matches) > MAX_MATCHES:
        return f"the pattern matches more than {MAX_MATCHES} files"
    for match in matches:
        problem = roots.readable(os.path.realpath(match))
        if problem is not None:
            return f"matches {match}, which {problem}" if problem.startswith("resolves") else problem
    return None


def _links_problem(folder: str, roots: Roots) -> str | None:
    """Why a folder read recursively reaches what the caller may not read (through links), or None."""
    seen = 0
    for parent, dirs, files in os.walk(folder):
        for name in dirs + files:
            seen += 1
            if seen > MAX_MATCHES:
                return f"the folder holds more than {MAX_MATCHES} entries"
            path = os.path.join(parent, name)
            # os.walk does not descend into linked folders: check where each link leads instead.
            if os.path.islink(path) and (problem := roots.tree_readable(os.path.realpath(path))):
                return f"{path} is a link that {problem}" if problem.startswith("resolves") else problem
    return None


def local_locations(spec: JobSpec, sections: tuple[str, ...] = ("dataset", "model")) -> Iterator[tuple[str, str, bool]]:
    """``(field, path, tree)`` for each local path the spec names in ``sections``, as the API stores them
    (absolute); ``tree``: the loader reads it recursively. Hub ids and URLs are not local paths."""
    found: list[tuple[str, str | None, bool]] = []
    if "model" in sections:
        found += [(f"model.{key}", getattr(spec.model, key), False) for key in MODEL_FIELDS]
    if "dataset" in sections:
        ds = spec.dataset
        found += [("dataset.path", ds.path, True), ("dataset.data_dir", ds.data_dir, True)]
        found += [(field, path, False) for field, path in data_file_entries(ds.data_files)]
    for field, path, tree in found:
        if isinstance(path, str) and is_local_path(path):
            yield field, path, tree


def check_reach(spec: JobSpec, reach: Reach | None, sections: tuple[str, ...] = ("dataset", "model")) -> None:
    """Raise :class:`SpecError` naming each local path of ``sections`` that ``reach`` does not cover now
    (None: no reach to keep, a run outside the service)."""
    if reach is None:
        return
    roots = reach.roots()
    errors = [
        FieldError(field, f"{path}: {problem} (checked again as the run opened it)", "forbidden_location")
        for field, path, tree in local_locations(spec, sections)
        if (problem := reach.problem(path, tree=tree, roots=roots))
    ]
    if errors:
        raise SpecError(errors)
