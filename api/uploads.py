"""Dataset uploads: one CSV / JSON lines / Parquet file, or a zip of an image or audio folder.

The upload is copied in chunks while it is hashed and measured, so a file over the limit stops at
the limit (413). Layout: ``<data root>/uploads/<owner>/<dataset id>/<file>``, or ``.../<dataset id>/data/``
for a folder; jobs may name only their owner's uploads (api/paths.py). On an object-store data root
the upload is checked and unpacked in a local staging folder first, then copied to the same layout there.

A zip is judged by its central directory before anything is written: more members than
:data:`MAX_ZIP_MEMBERS`, declared sizes summing past :data:`ZIP_INFLATE_FACTOR` times the upload limit,
or a member inflating more than :data:`MAX_ZIP_RATIO` times its compressed size is refused at once
(413 naming the limit), as are absolute names, ``..`` and links (422: zip slip). It is then unpacked
from the request's own spooled body, member by member, counting the real bytes: an archive whose
directory lies about its sizes is cut off at the unpacked limit all the same, and the folder removed.
"""

from __future__ import annotations

import hashlib
import posixpath
import re
import shutil
import stat
import tempfile
import zipfile
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.problems import Problem, problem_response, validation_problem
from service_core.datastore import DataStore
from trainer_core.path_guard import UPLOADS_DIR
from trainer_core.spec import FieldError

CHUNK = 1 << 20
MIB = 1 << 20
FILE_FORMATS = {".csv": "csv", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# Every name an upload may have ends in one of these (a .zip holds an image or audio folder).
UPLOAD_SUFFIXES = (*FILE_FORMATS, ".zip")
IMAGE_SUFFIXES = frozenset({".png", ".jpg", ".jpeg", ".gif", ".bmp", ".webp", ".tif", ".tiff"})
AUDIO_SUFFIXES = frozenset({".wav", ".flac", ".mp3", ".ogg", ".m4a", ".opus"})
# A zip may inflate to this many times the upload limit (images and audio barely compress).
ZIP_INFLATE_FACTOR = 4
MAX_ZIP_MEMBERS = 200_000
# Pictures and sounds barely compress (PNG, JPEG, MP3 about 1x; a flat BMP or a quiet WAV some tens):
# a member inflating more than this is a bomb. Members up to ZIP_RATIO_FLOOR are exempt (a tiny
# blank image compresses far better); the total bound holds for them.
MAX_ZIP_RATIO = 100
ZIP_RATIO_FLOOR = MIB
# Room for the multipart envelope around the file when checking Content-Length.
MULTIPART_SLACK = 64 * 1024


@dataclass(frozen=True)
class StoredUpload:
    format: str
    content_hash: str
    size_bytes: int
    storage_path: str  # relative to the data root


def dataset_prefix(owner: str, dataset_id: str) -> str:
    """An upload's folder, relative to the data root."""
    return f"{UPLOADS_DIR}/{owner}/{dataset_id}"


def too_large(limit_bytes: int) -> Problem:
    return Problem(413, f"uploads are limited to {limit_bytes // MIB} MiB (TRAINJOBS_MAX_UPLOAD_MB)")


def unpacks_too_large(limit_bytes: int, what: str) -> Problem:
    """The 413 of a zip over its unpacked limit; ``what`` says how it showed (declared, or while unpacking)."""
    limit = limit_bytes * ZIP_INFLATE_FACTOR // MIB
    return Problem(413, f"{what}: a zip may unpack to at most {limit} MiB "
                        f"({ZIP_INFLATE_FACTOR} x TRAINJOBS_MAX_UPLOAD_MB)")  # fmt: skip


def _bad_file(message: str) -> Problem:
    return validation_problem([FieldError("file", message, "invalid_upload")], title="Invalid upload")


def safe_filename(name: str) -> str:
    base = re.sub(r"[^A-Za-z0-9._-]", "_", posixpath.basename(name.replace("\\", "/"))).lstrip(".")
    return base[:200] or "upload"


def copy_limited(src: BinaryIO, dest: Path | None, limit_bytes: int) -> tuple[str, int]:
    """Copy ``src`` to ``dest`` (None: only read it) hashing it; returns (sha256 hex, size). 413 past the limit."""
    digest, size = hashlib.sha256(), 0
    with dest.open("wb") if dest is not None else nullcontext() as out:
        while chunk := src.read(CHUNK):
            size += len(chunk)
            if size > limit_bytes:
                raise too_large(limit_bytes)
            digest.update(chunk)
            if out is not None:
                out.write(chunk)
    return digest.hexdigest(), size


def _member_path(info: zipfile.ZipInfo) -> str | None:
    """The member's safe relative path, None for entries to skip; raises for hostile names."""
    name = info.filename.replace("\\", "/")
    if stat.S_ISLNK(info.external_attr >> 16):
        raise _bad_file(f"zip member {info.filename!r} is a link")
    norm = posixpath.normpath(name)
    if name.startswith("/") or re.match(r"^[A-Za-z]:", name) or norm == ".." or norm.startswith("../"):
        raise _bad_file(f"zip member {info.filename!r} would land outside the dataset folder")
    parts = norm.split("/")
    if info.is_dir() or parts[0] == "__MACOSX" or any(p.startswith(".") for p in parts):
        return None
    return norm


def folder_format(members: list[str]) -> str:
    suffixes = {posixpath.splitext(m)[1].lower() for m in members}
    images, audio = bool(suffixes & IMAGE_SUFFIXES), bool(suffixes & AUDIO_SUFFIXES)
    if images == audio:
        raise _bad_file("a zip must hold an image folder or an audio folder (one of them)")
    return "imagefolder" if images else "audiofolder"


def check_zip_directory(infos: list[zipfile.ZipInfo], limit_bytes: int) -> None:
    """Refuse, from what the central directory declares, a zip over the limits (413 naming the one that
    tripped): called before a byte of it is written."""
    if len(infos) > MAX_ZIP_MEMBERS:
        raise Problem(413, f"the zip holds {len(infos)} members: a zip may hold at most {MAX_ZIP_MEMBERS}")
    declared = sum(info.file_size for info in infos)
    if declared > limit_bytes * ZIP_INFLATE_FACTOR:
        raise unpacks_too_large(limit_bytes, f"the zip declares {declared / MIB:.1f} MiB unpacked")
    for info in infos:
        if info.file_size > ZIP_RATIO_FLOOR and info.file_size > MAX_ZIP_RATIO * max(info.compress_size, 1):
            ratio = info.file_size // max(info.compress_size, 1)
            raise Problem(413, f"zip member {info.filename!r} inflates {ratio} times its compressed size: "
                               f"a member larger than {ZIP_RATIO_FLOOR // MIB} MiB may inflate at most "
                               f"{MAX_ZIP_RATIO} times")  # fmt: skip


def open_zip(src: BinaryIO, limit_bytes: int) -> tuple[zipfile.ZipFile, list[tuple[zipfile.ZipInfo, str]], str]:
    """The zip in ``src``, its members to unpack with their safe paths, and its builder; everything is
    judged from the central directory (nothing written), a Problem when the zip may not be unpacked."""
    try:
        zf = zipfile.ZipFile(src)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as exc:  # not a zip, or a truncated one
        raise _bad_file("not a readable zip file") from exc
    try:
        infos = zf.infolist()
        check_zip_directory(infos, limit_bytes)
        members = [(info, path) for info in infos if (path := _member_path(info)) is not None]
        return zf, members, folder_format([path for _, path in members])
    except BaseException:
        zf.close()
        raise


def unpack_zip(zf: zipfile.ZipFile, members: list[tuple[zipfile.ZipInfo, str]], dest: Path, limit_bytes: int) -> None:
    """Unpack the checked ``members`` into ``dest``, counting the real bytes: the backstop for a
    directory that declares less than its data inflates to."""
    budget = limit_bytes * ZIP_INFLATE_FACTOR
    for info, path in members:
        try:
            budget = _extract_member(zf, info, dest / path, budget)
        # corrupt data, encryption, unknown compression, a file where a folder should be
        except (OSError, zipfile.BadZipFile, NotImplementedError, RuntimeError) as exc:
            raise _bad_file(f"zip member {info.filename!r} cannot be unpacked: {exc}") from exc
        if budget < 0:
            raise unpacks_too_large(limit_bytes, f"zip member {info.filename!r} unpacked past what the zip declared")


def _extract_member(zf: zipfile.ZipFile, info: zipfile.ZipInfo, target: Path, budget: int) -> int:
    """Write one member, counting real bytes (not the header's claim); returns the budget left."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with zf.open(info) as src, target.open("wb") as out:
        while (chunk := src.read(CHUNK)) and budget >= 0:
            budget -= len(chunk)
            out.write(chunk)
    return budget


def store_upload(src: BinaryIO, filename: str, dataset_dir: Path, data_root: Path, limit_bytes: int) -> StoredUpload:
    """Store one upload under ``dataset_dir``; on any error nothing is left behind. A zip is checked
    (its directory, then its size and hash) before the folder exists, and unpacked from ``src`` itself."""
    name = safe_filename(filename)
    suffix = posixpath.splitext(name)[1].lower()
    if suffix != ".zip" and suffix not in FILE_FORMATS:
        raise _bad_file(f"unsupported file type {suffix or name!r}: use .csv, .jsonl, .json, .parquet or .zip")
    if suffix == ".zip":
        zf, members, fmt = open_zip(src, limit_bytes)
        with zf:
            src.seek(0)
            content_hash, size = copy_limited(src, None, limit_bytes)
            target = dataset_dir / "data"
            dataset_dir.mkdir(parents=True, exist_ok=False)
            try:
                unpack_zip(zf, members, target, limit_bytes)
            except BaseException:
                shutil.rmtree(dataset_dir, ignore_errors=True)
                raise
    else:
        target = dataset_dir / name
        dataset_dir.mkdir(parents=True, exist_ok=False)
        try:
            content_hash, size = copy_limited(src, target, limit_bytes)
        except BaseException:
            shutil.rmtree(dataset_dir, ignore_errors=True)
            raise
        fmt = FILE_FORMATS[suffix]
    return StoredUpload(fmt, content_hash, size, target.relative_to(data_root).as_posix())


def save_upload(
    src: BinaryIO, filename: str, store: DataStore, prefix: str, limit_bytes: int, staging: Path
) -> StoredUpload:
    """:func:`store_upload` into the data root at ``prefix``: in place on a local root; on a store, through
    a temporary folder under ``staging``. A store that does not take it is a 503, leaving nothing there."""
    if store.is_local:
        root = Path(store.root)
        return store_upload(src, filename, root / prefix, root, limit_bytes)
    staging.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=staging, prefix="upload-") as tmp:
        stored = store_upload(src, filename, Path(tmp) / prefix, Path(tmp), limit_bytes)
        try:
            store.put_folder(Path(tmp) / prefix, prefix)
        except Exception as exc:  # any client error of the store (network, permissions, quota)
            store.remove(prefix)
            raise Problem(503, f"the data store did not take the upload ({type(exc).__name__}); nothing was "
                          "stored, upload again later", headers={"Retry-After": "5"}) from exc  # fmt: skip
    return stored


class BodyTooLarge(HTTPException):
    """Raised from ``receive`` once a body passes its limit; FastAPI passes HTTPExceptions through."""

    def __init__(self, detail: str):
        super().__init__(413, detail)


class BodyLimitMiddleware:
    """Limit request bodies while they stream in: uploads to ``upload_limit``, the rest to ``json_limit``.

    A Content-Length over the limit is answered 413 before anything is read; a chunked body (no
    Content-Length) or one that lies is cut off as soon as the bytes received pass the limit, so
    the multipart parser never spools more than the limit to a temporary file.
    """

    def __init__(self, app: ASGIApp, *, upload_path: str, upload_limit: int, json_limit: int):
        self.app, self.upload_path = app, upload_path
        self.upload_limit, self.json_limit = upload_limit, json_limit

    def limit_for(self, path: str) -> tuple[int, str]:
        if path == self.upload_path:
            return self.upload_limit + MULTIPART_SLACK, too_large(self.upload_limit).detail or ""
        kib = self.json_limit // 1024
        return self.json_limit, f"request bodies are limited to {kib} KiB (TRAINJOBS_MAX_JSON_KB)"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        limit, detail = self.limit_for(scope["path"])
        length = dict(scope["headers"]).get(b"content-length")
        if length and length.isdigit() and int(length) > limit:
            await problem_response(Problem(413, detail))(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(detail)
            return message

        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            # Read outside FastAPI's body parsing (which turns it into the 413 problem itself).
            if started:
                raise
            await problem_response(Problem(413, detail))(scope, receive, send)
