"""Artifact storage under ``ARTIFACTS_ROOT``: a local path or any fsspec URL (``s3://bucket/prefix``).

Workers on other machines write where the API reads, so both go through this one class. Paths are
relative to a job's folder and may not escape it.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import fsspec


class ArtifactPathError(ValueError):
    """A requested artifact path that is absolute or climbs out of the job's folder."""


def clean_relative_path(path: str) -> str:
    norm = posixpath.normpath(path.replace("\\", "/"))
    if norm.startswith("/") or norm == ".." or norm.startswith("../") or norm in ("", "."):
        raise ArtifactPathError(f"artifact path {path!r} must be relative and stay inside the job")
    return norm


class ArtifactStore:
    def __init__(self, root: str):
        self.fs, self.root = fsspec.core.url_to_fs(root)
        self.root = self.root.rstrip("/")

    def job_dir(self, job_id: str) -> str:
        return f"{self.root}/{job_id}"

    def upload_dir(self, job_id: str, local_dir: Path, *, skip: tuple[str, ...] = ()) -> None:
        """Copy a finished run's folder into the job's artifacts (a no-op copy when already there)."""
        target = self.job_dir(job_id)
        for file in sorted(p for p in local_dir.rglob("*") if p.is_file()):
            rel = file.relative_to(local_dir).as_posix()
            if rel.startswith(skip):
                continue
            dest = f"{target}/{rel}"
            if Path(dest).resolve() == file.resolve():
                continue
            self.fs.makedirs(posixpath.dirname(dest), exist_ok=True)
            self.fs.put_file(str(file), dest)

    def list(self, job_id: str) -> list[dict[str, Any]]:
        """Files of a job: ``path`` (relative) and ``size`` in bytes, sorted by path."""
        base = self.job_dir(job_id)
        self.fs.invalidate_cache(base)  # other machines write here: never answer from an old listing
        if not self.fs.exists(base):
            return []
        out = []
        for full, info in sorted(self.fs.find(base, detail=True).items()):
            rel = posixpath.relpath(full, base)
            out.append({"path": rel, "size": int(info.get("size") or 0)})
        return out

    def exists(self, job_id: str, path: str) -> bool:
        self.fs.invalidate_cache(self.job_dir(job_id))
        return bool(self.fs.isfile(f"{self.job_dir(job_id)}/{clean_relative_path(path)}"))

    def open(self, job_id: str, path: str) -> IO[bytes]:
        opened: IO[bytes] = self.fs.open(f"{self.job_dir(job_id)}/{clean_relative_path(path)}", "rb")
        return opened

    def iter_bytes(self, job_id: str, path: str, chunk_size: int = 1 << 20) -> Iterator[bytes]:
        with self.open(job_id, path) as handle:
            while chunk := handle.read(chunk_size):
                yield chunk
