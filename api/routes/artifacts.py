"""A job's artifacts: the final model, tokenizer, metrics.json and the worker's log."""

from __future__ import annotations

import mimetypes
import posixpath

from fastapi import APIRouter
from fastapi.responses import StreamingResponse

from api.deps import ArtifactsDep, OwnedJob
from api.problems import Problem
from api.schemas.common import problem_responses
from api.schemas.datasets import ArtifactList, ArtifactOut
from service_core.artifacts import ArtifactPathError, clean_relative_path

router = APIRouter(prefix="/v1/jobs", tags=["artifacts"], responses=problem_responses(401, 404, 422))


@router.get("/{job_id}/artifacts", response_model=ArtifactList)
def list_artifacts(job: OwnedJob, store: ArtifactsDep) -> ArtifactList:
    """Every file the job stored, with its size; empty until the worker uploads them."""
    return ArtifactList(items=[ArtifactOut(**item) for item in store.list(job.id)])


@router.get(
    "/{job_id}/artifacts/{path:path}",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}}}},
)
def download_artifact(job: OwnedJob, path: str, store: ArtifactsDep) -> StreamingResponse:
    """One artifact's bytes (streamed; works for local and fsspec artifact roots alike)."""
    try:
        clean = clean_relative_path(path)
    except ArtifactPathError as exc:
        raise Problem(422, str(exc), errors=[{"field": "path", "message": str(exc)}]) from exc
    if not store.exists(job.id, clean):
        raise Problem(404, f"job {job.id} has no artifact {clean!r}")
    media_type = mimetypes.guess_type(clean)[0] or "application/octet-stream"
    filename = posixpath.basename(clean).replace('"', "")
    headers = {"Content-Disposition": f'attachment; filename="{filename}"'}
    return StreamingResponse(store.iter_bytes(job.id, clean), media_type=media_type, headers=headers)
