"""A job's checkpoints in the object store: ``ARTIFACTS_ROOT/<job>/checkpoints/<step>/``.

Used when ``ARTIFACTS_ROOT`` is remote (``s3://...``): the worker slot uploads each checkpoint its run
saves (worker/checkpoint_upload.py), and the resume of any attempt, on any host, downloads the newest
one (worker/execute.py). An upload puts every file first and ``manifest.json`` (each file's size and
sha256, the step, the attempt) last, so a checkpoint counts only once whole: an upload cut off by a
lost host leaves a folder without a manifest, which listing ignores. A download checks every size and
hash before the checkpoint appears, under its local name, in one rename.

A host cut off from the network may come back after its job moved to another attempt, with requests
still in flight. Nothing such a fenced-out attempt sends can change a checkpoint the job counts on:
- its files go to a folder of its own (``<step>/attempt-<n>/``, named by the manifest), so a late
  write never overwrites the files of another attempt's checkpoint at the same step;
- its manifest is written only right after the attempt renewed its lease, through a presigned PUT
  that the store itself refuses once half a lease has passed since the renewal was asked
  (``commit_within_s``, less whatever the renewal's answer took: one that arrives late renewed a
  lease that may be gone). No other attempt
  can claim the job before the lease runs out, so a manifest delivered late is refused, never
  committed over a newer attempt's. This assumes the hosts' clocks agree to within that margin, as
  the leases themselves do. A store other than S3 gets a plain write, without that guarantee.

:func:`job_checkpoints` is what users see (the API's list and download): the store's complete
checkpoints and, for steps that have not landed there, the artifacts root's own ``checkpoint-<step>``
folders (a local root is trained into directly: there a folder is complete once its meta file is).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import posixpath
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from service_core.artifacts import ArtifactStore, clean_relative_path
from trainer_core.checkpoint import CHECKPOINT_PREFIX, META_FILE, checkpoint_dir

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
CHECKPOINTS_DIR = "checkpoints"
# A commit refused or timed out (a slow store) is tried again this many times, each after a renewal.
COMMIT_TRIES = 3


class CheckpointError(RuntimeError):
    """A stored checkpoint that cannot be used: a file missing, or its size or sha256 not the manifest's."""


class CommitRefused(RuntimeError):
    """The store refused a manifest's write (its presigned URL had expired, or another error)."""


@dataclass(frozen=True)
class ManifestEntry:
    path: str  # relative to the checkpoint folder, "/"-separated
    size: int
    sha256: str


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def describe_folder(folder: Path) -> list[ManifestEntry]:
    """Every file under ``folder`` with its size and sha256, sorted by path."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    return [ManifestEntry(p.relative_to(folder).as_posix(), p.stat().st_size, sha256_file(p)) for p in files]


class CheckpointStore:
    """One job's checkpoints under an artifacts root (any fsspec URL; the deployment's is ``s3://``)."""

    def __init__(self, artifacts_root: str, job_id: str) -> None:
        artifacts = ArtifactStore(artifacts_root)
        self.fs = artifacts.fs
        self.base = f"{artifacts.job_dir(job_id)}/{CHECKPOINTS_DIR}"
        self.job_id = job_id

    def step_dir(self, step: int) -> str:
        return f"{self.base}/{step}"

    def steps(self) -> list[int]:
        """Steps of the complete checkpoints (those with a manifest), oldest first."""
        return sorted(step for step, complete in self._folders().items() if complete)

    def _folders(self) -> dict[int, bool]:
        """Every step folder in the store, and whether it is complete (read fresh, never from a cache:
        other hosts write here)."""
        self.fs.invalidate_cache(self.base)
        try:
            found = self.fs.find(self.base)
        except FileNotFoundError:
            return {}
        folders: dict[int, bool] = {}
        for full in found:
            step_name, _, rest = posixpath.relpath(full, self.base).partition("/")
            if step_name.isdigit():
                folders[int(step_name)] = folders.get(int(step_name), False) or rest == MANIFEST
        return folders

    def upload(self, folder: Path, step: int, attempt: int | None, *, may_commit: Callable[[], bool] = lambda: True,
               commit_within_s: float | None = None) -> bool:  # fmt: skip
        """Upload a local checkpoint folder as ``step``: every file (into the attempt's own folder),
        then the manifest, last.

        ``may_commit`` is asked right before each try at writing the manifest: False (the attempt was
        fenced out meanwhile) leaves the upload incomplete, so it never counts. ``commit_within_s``: the
        manifest write is one the store refuses after that many seconds (see the module's docstring),
        counted from when ``may_commit`` was asked: a renewal whose answer comes late (a host cut off
        while it was in flight) renewed a lease that may have run out since, so the window shrinks by
        the time it took, and a try with under a second left is not made. Returns whether it was
        committed.
        """
        entries = describe_folder(folder)
        files = f"attempt-{attempt}" if attempt is not None else ""
        target = self.step_dir(step)
        for entry in entries:
            dest = posixpath.join(target, files, entry.path)
            self.fs.makedirs(posixpath.dirname(dest), exist_ok=True)
            self.fs.put_file(str(folder / entry.path), dest)
        manifest = {"step": step, "attempt": attempt, "folder": files, "files": [vars(e) for e in entries]}
        data = json.dumps(manifest, indent=1).encode()
        for tried in range(1, COMMIT_TRIES + 1):
            asked = time.monotonic()
            if not may_commit():
                log.warning("job %s: checkpoint %d uploaded but not committed: attempt %s no longer owns the job",
                            self.job_id, step, attempt)  # fmt: skip
                return False
            left = None if commit_within_s is None else commit_within_s - (time.monotonic() - asked)
            try:
                if commit_within_s is not None and left is not None and left < 1:
                    raise CommitRefused(f"the renewal took {commit_within_s - left:.1f} s of a {commit_within_s:g} s "
                                        "window")  # fmt: skip
                self._write_within(f"{target}/{MANIFEST}", data, left)
                return True
            except (httpx.TimeoutException, CommitRefused) as exc:
                if tried == COMMIT_TRIES:
                    raise
                log.warning("job %s: committing checkpoint %d: %s; trying again", self.job_id, step, exc)
        raise AssertionError("unreachable")  # the loop returns or raises

    def _write_within(self, path: str, data: bytes, within_s: float | None) -> None:
        """Write ``data`` at ``path``; with ``within_s``, on S3, through a presigned PUT that the store
        refuses once ``within_s`` seconds (at least one) have passed, however late it arrives."""
        protocols = (self.fs.protocol,) if isinstance(self.fs.protocol, str) else self.fs.protocol
        if within_s is None or "s3" not in protocols:
            self.fs.pipe_file(path, data)
            return
        response = httpx.put(self.commit_url(path, within_s), content=data, timeout=within_s)
        if response.status_code != 200:
            raise CommitRefused(f"the store answered {response.status_code}: {response.text[:200]}")
        self.fs.invalidate_cache(self.base)

    def commit_url(self, path: str, within_s: float) -> str:
        """A presigned S3 PUT of ``path`` that the store refuses after ``within_s`` seconds (at least one)."""
        url: str = self.fs.url(path, expires=max(1, int(within_s)), client_method="put_object")
        return url

    def files_dir(self, step: int, manifest: dict[str, Any]) -> str:
        """The folder that holds checkpoint ``step``'s files, as its manifest names it (none before
        attempts had folders of their own: the step's folder)."""
        return posixpath.join(self.step_dir(step), manifest.get("folder") or "").rstrip("/")

    def manifest(self, step: int) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.fs.cat_file(f"{self.step_dir(step)}/{MANIFEST}"))
        return data

    def download(self, step: int, output_dir: Path) -> Path:
        """Fetch checkpoint ``step`` into ``output_dir/checkpoint-<step>`` and return that folder.

        Files land in a temporary folder beside it and are checked against the manifest (size and
        sha256); only a whole checkpoint is renamed into place. Raises :class:`CheckpointError` otherwise.
        """
        manifest = self.manifest(step)
        entries = [ManifestEntry(**item) for item in manifest["files"]]
        return self.fetch_folder(self.files_dir(step, manifest), step, entries, checkpoint_dir(output_dir, step))

    def fetch_folder(self, source: str, step: int, entries: list[ManifestEntry], final: Path) -> Path:
        """Fetch ``entries`` of the checkpoint folder ``source`` (a path on this store's file system) into
        ``final``: into a temporary folder beside it first, each file checked against its entry (its
        size, and its sha256 where the entry has one: a manifest's), then renamed into place whole.
        Raises :class:`CheckpointError` for a file missing or not as its entry says."""
        final.parent.mkdir(parents=True, exist_ok=True)
        # A name the trainer's own checkpoint globs (checkpoint-*) never match.
        partial = Path(tempfile.mkdtemp(prefix=f".download-{step}-", dir=final.parent))
        try:
            for entry in entries:
                self._fetch_file(source, step, entry, partial)
            shutil.rmtree(final, ignore_errors=True)  # an incomplete local copy of the same step
            partial.rename(final)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        return final

    def _fetch_file(self, source: str, step: int, entry: ManifestEntry, into: Path) -> None:
        local = into / clean_relative_path(entry.path)  # a manifest names files inside its checkpoint
        local.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.fs.get_file(f"{source}/{entry.path}", str(local))
        except FileNotFoundError as exc:  # never there, or rotated away meanwhile
            raise CheckpointError(f"checkpoint {step}: {entry.path} is missing from the store") from exc
        size = local.stat().st_size
        digest = sha256_file(local) if entry.sha256 else ""  # a run's own folder has no manifest to hash by
        if (size, digest) != (entry.size, entry.sha256):
            found, wanted = f"{size} bytes, sha256 {digest[:12]}", f"{entry.size} bytes, sha256 {entry.sha256[:12]}"
            raise CheckpointError(f"checkpoint {step}: {entry.path} is {found}; the manifest says {wanted}")

    def delete(self, step: int) -> None:
        """Remove checkpoint ``step``: its manifest first, so that it stops counting before it goes."""
        target = self.step_dir(step)
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(f"{target}/{MANIFEST}")
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm(target, recursive=True)
        self.fs.invalidate_cache(self.base)

    def rotate(self, keep: int | None, protect: int | None = None) -> list[int]:
        """Keep the newest ``keep`` complete checkpoints (None keeps all) and the one at step ``protect``
        (the best, trainer_core/best_checkpoint.py) when older; remove other older ones and incomplete
        uploads older than the newest complete one. Returns the steps removed."""
        folders = self._folders()
        complete = sorted(step for step, whole in folders.items() if whole)
        if not complete:
            return []
        older = complete[: max(len(complete) - keep, 0)] if keep is not None else []
        doomed = [step for step in older if step != protect]
        doomed += [step for step, whole in folders.items() if not whole and step < complete[-1]]
        for step in sorted(doomed):
            self.delete(step)
        return sorted(doomed)


@dataclass(frozen=True)
class StoredCheckpoint:
    """A complete checkpoint as users see it: its ``folder`` (relative to the job's artifacts) and files."""

    step: int
    folder: str  # checkpoints/<step>/attempt-<n> (the store's) or checkpoint-<step> (a run's own, on the root)
    files: list[ManifestEntry]  # sha256 empty where the folder has no manifest
    taken_at: datetime

    @property
    def size(self) -> int:
        return sum(entry.size for entry in self.files)


def _modified(fs: Any, path: str) -> datetime:
    when: datetime = fs.modified(path)
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def job_checkpoints(artifacts_root: str, job_id: str) -> dict[int, StoredCheckpoint]:
    """A job's complete checkpoints by step, oldest first: the store's (manifest committed) and, for
    steps not there, the artifacts root's ``checkpoint-<step>`` folders with their meta file. One that
    rotation removes while it is read is left out."""
    store = CheckpointStore(artifacts_root, job_id)
    job_dir = posixpath.dirname(store.base)
    found: dict[int, StoredCheckpoint] = {}
    for step in store.steps():
        with contextlib.suppress(FileNotFoundError):
            manifest = store.manifest(step)
            entries = [ManifestEntry(**item) for item in manifest["files"]]
            taken = _modified(store.fs, f"{store.step_dir(step)}/{MANIFEST}")
            folder = posixpath.relpath(store.files_dir(step, manifest), job_dir)
            found[step] = StoredCheckpoint(step, folder, entries, taken)
    try:
        children = store.fs.ls(job_dir, detail=False)
    except FileNotFoundError:
        children = []
    for child in children:
        name = posixpath.basename(child.rstrip("/"))
        step_text = name.removeprefix(CHECKPOINT_PREFIX)
        if name == step_text or not step_text.isdigit() or int(step_text) in found:
            continue
        with contextlib.suppress(FileNotFoundError):
            taken = _modified(store.fs, f"{child}/{META_FILE}")  # none yet: still being written
            files = store.fs.find(child, detail=True)
            entries = [ManifestEntry(posixpath.relpath(path, child), int(info.get("size") or 0), "")
                       for path, info in sorted(files.items())]  # fmt: skip
            found[int(step_text)] = StoredCheckpoint(int(step_text), name, entries, taken)
    return dict(sorted(found.items()))


# Files of a checkpoint that hold the optimizer's state: optimizer.pt (Trainer), optimizer.bin (accelerate).
OPTIMIZER_PREFIX = "optimizer"


def fetch_checkpoint(artifacts_root: str, job_id: str, step: int, dest: Path, *, with_optimizer: bool) -> Path:
    """A copy of job ``job_id``'s checkpoint ``step`` (as :func:`job_checkpoints` finds it, on the store
    or the root's own folders) in ``dest``, the optimizer state only ``with_optimizer``; kept when
    already there (a restarted run's). Whole and checked, as :meth:`CheckpointStore.fetch_folder` fetches.

    For ``init_from`` (worker/execute.py): the new run reads its own copy, which the other job's
    retention cannot delete under it. Raises :class:`CheckpointError` when the checkpoint is gone.
    """
    if dest.is_dir():
        return dest
    found = job_checkpoints(artifacts_root, job_id).get(step)
    if found is None:
        raise CheckpointError(f"job {job_id} no longer has a complete checkpoint at step {step}")
    store = CheckpointStore(artifacts_root, job_id)
    entries = [entry for entry in found.files if with_optimizer or not entry.path.startswith(OPTIMIZER_PREFIX)]
    return store.fetch_folder(f"{posixpath.dirname(store.base)}/{found.folder}", step, entries, dest)
