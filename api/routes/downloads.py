"""A job's whole output in one response: ``GET /v1/jobs/{id}/artifacts.zip``, streamed as it is zipped.

Nothing is staged on disk or held in memory beyond one chunk: each file is read from the artifact
store and written into the archive as it goes (``zipfile`` writes data descriptors on a stream that
cannot seek). Files are stored, not deflated: weights hardly compress, and the CPU stays free.
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterator

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from api.deps import ArtifactsDep, OwnedJob
from api.problems import Problem
from api.schemas.common import problem_responses
from service_core.artifacts import ArtifactStore

router = APIRouter(prefix="/v1/jobs", tags=["artifacts"], responses=problem_responses(401, 404))


class _Pipe:
    """A write-only file for ``zipfile`` whose bytes are taken out after each write."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []

    def write(self, data: bytes) -> int:
        self.chunks.append(bytes(data))
        return len(data)

    def flush(self) -> None:
        """Nothing buffered here: ``drain`` hands the bytes on."""

    def close(self) -> None:
        """Nothing to release."""

    def drain(self) -> bytes:
        data, self.chunks = b"".join(self.chunks), []
        return data


def zip_stream(store: ArtifactStore, job_id: str, paths: list[str], names: list[str] | None = None) -> Iterator[bytes]:
    """The bytes of a zip archive of ``paths`` (relative to the job's folder), chunk by chunk; each named
    in the archive by its path, or by ``names`` (one per path) when given."""
    pipe = _Pipe()
    with zipfile.ZipFile(pipe, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
        for path, name in zip(paths, names or paths, strict=True):
            with archive.open(name, "w", force_zip64=True) as member:
                for chunk in store.iter_bytes(job_id, path):
                    member.write(chunk)
                    if data := pipe.drain():
                        yield data
    if data := pipe.drain():  # the central directory, written on close
        yield data


@router.get(
    "/{job_id}/artifacts.zip",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/zip": {}}}},
)
def download_artifacts_zip(job: OwnedJob, store: ArtifactsDep) -> StreamingResponse:
    """Every artifact of the job (model, tokenizer, metrics, log) as one zip, with their relative paths."""
    paths = [item["path"] for item in store.list(job.id)]
    if not paths:
        raise Problem(404, f"job {job.id} has no artifacts yet")
    headers = {"Content-Disposition": f'attachment; filename="{job.id}.zip"'}
    return StreamingResponse(zip_stream(store, job.id, paths), media_type="application/zip", headers=headers)
