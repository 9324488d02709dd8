"""Local data locations as the `datasets` loader reads them: patterns, folders and links resolved.

`datasets` expands ``*``, ``**``, ``?`` and ``[..]`` in ``data_files`` (fsspec glob) and reads a
``data_dir`` or a local dataset folder recursively. A prefix check on the written path is therefore
not enough: ``upload[s]/bob/*/x.csv`` or ``**/x.csv`` names no upload folder yet reaches one. The
rule here: the part of a path before its first pattern character (its literal folder) is resolved
with ``realpath``; a pattern or a folder read is allowed only when that folder cannot contain other
owners' uploads, and every file the pattern matches now is resolved and checked too (links).
Braces and percent-encoded characters are refused outright in local paths: no loader needs them,
and a checker that guessed their meaning wrong would be a hole. On an object-store data root the same
rules hold (:func:`store_problem`), with the pattern expanded by the store's fsspec glob; objects
have no links, so the literal folder alone decides.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from fsspec import AbstractFileSystem
from fsspec.implementations.local import LocalFileSystem

GLOB_CHARS = frozenset("*?[]")
_REFUSED = re.compile(r"[{}]|%[0-9A-Fa-f]{2}|::")
# A pattern matching (or a folder holding) more entries than this is refused rather than checked
# entry by entry; uploads are exempt (they hold no links to check).
MAX_MATCHES = 100_000


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


def under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def literal_base(path: str) -> tuple[str, bool]:
    """The folder before the first pattern character of an absolute ``path``, and whether it has one."""
    parts = path.split("/")
    for i, part in enumerate(parts):
        if GLOB_CHARS & set(part):
            return "/".join(parts[:i]) or "/", True
    return path, False


def local_problem(path: str, roots: Roots, *, tree: bool) -> str | None:
    """Why an absolute local ``path`` (maybe a pattern) must not be read by this caller, or None.

    ``tree``: the loader reads the location recursively (``data_dir``, a local dataset folder).
    """
    if _REFUSED.search(path):
        return "braces, `::` and percent-encoded characters are not allowed in local paths"
    base, pattern = literal_base(path)
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


def store_problem(url: str, roots: Roots, fs: AbstractFileSystem, *, tree: bool) -> str | None:
    """Why a ``url`` (maybe a pattern) under an object-store data root must not be read by this caller,
    or None; ``roots`` hold URLs (an object store has no links to resolve)."""
    if _REFUSED.search(url.split("://", 1)[-1]):
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
