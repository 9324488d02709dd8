"""Datasets: upload a file or a zipped folder once, then point jobs at it with ``{"dataset": {"id": ...}}``."""

from __future__ import annotations

import re
from functools import partial
from typing import Annotated

import anyio.to_thread
from fastapi import APIRouter, File, Form, Request, UploadFile, status
from fastapi.responses import JSONResponse
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from api.deps import CallerDep, SessionDep, SessionFactoryDep, SettingsDep, owned_dataset
from api.idempotency import Idempotency, IdempotencyKeyHeader, KeyTaken, exit_if_asked, fingerprint
from api.problems import Problem
from api.schemas.common import problem_responses
from api.schemas.datasets import DatasetList, DatasetOut
from api.uploads import UPLOAD_SUFFIXES, copy_limited, dataset_prefix, save_upload
from service_core.datastore import DataStore
from service_core.db.base import new_id
from service_core.db.models import Dataset
from service_core.keys import Caller
from service_core.settings import Settings

router = APIRouter(prefix="/v1/datasets", tags=["datasets"], responses=problem_responses(401, 404, 413, 422, 429))

UPLOAD_EXAMPLE = """Example:

    curl -H "Authorization: Bearer $TRAINJOBS_API_KEY" \\
         -F file=@reviews.csv -F name=reviews http://127.0.0.1:8000/v1/datasets

then submit a job with `"dataset": {"id": "<the returned id>", "text_column": "text", "label_column": "label"}`.
"""


# What store_upload accepts, said where a client (and a fuzzer) reads it: the file part's name must
# end in one of the known suffixes. Random bytes in a .csv are stored (jobs read them later); a .zip
# must be a zip of an image or audio folder, or it is a 422.
_SUFFIXES = "|".join(re.escape(suffix.lstrip(".")) for suffix in UPLOAD_SUFFIXES)
_NAME = r'[^"/\\\x00-\x1f]{0,150}[^"/\\.\x00-\x1f]'
# PostgreSQL's text columns refuse NUL: a name carrying one is a 422 naming it, not a 500 at INSERT.
NO_NUL = r"^[^\x00]*$"
_FILE_PART = {
    "headers": {
        "Content-Disposition": {
            "description": "The file's name says its format: " + ", ".join(UPLOAD_SUFFIXES) + ".",
            # The name survives api/uploads.safe_filename with its suffix: no folders, not all dots, short.
            "schema": {"type": "string", "pattern": rf'^form-data; name="file"; filename="{_NAME}\.({_SUFFIXES})"$'},
            "example": 'form-data; name="file"; filename="reviews.csv"',
        }
    }
}


@router.post(
    "",
    status_code=status.HTTP_201_CREATED,
    response_model=DatasetOut,
    responses=problem_responses(409),  # a race on one Idempotency-Key (api/idempotency.py)
    openapi_extra={"requestBody": {"content": {"multipart/form-data": {"encoding": {"file": _FILE_PART}}}}},
    description="Upload a CSV, JSON lines or Parquet file, or a zip of an image or audio folder "
    "(class-named subfolders). The sha256 of the upload is stored.\n\n" + UPLOAD_EXAMPLE,
)
async def upload_dataset(
    request: Request,
    file: Annotated[UploadFile, File(description=".csv, .jsonl, .json, .parquet or .zip (image/audio folder)")],
    sessions: SessionFactoryDep,
    settings: SettingsDep,
    caller: CallerDep,
    idempotency_key: IdempotencyKeyHeader = None,
    name: Annotated[str | None, Form(max_length=256, pattern=NO_NUL, examples=["reviews"])] = None,
) -> DatasetOut | JSONResponse:
    # On the uploads' own threads (api.main.UPLOAD_THREADS): storing a large upload takes a while.
    keyed = Idempotency.of(caller.owner, idempotency_key)
    store = partial(store_dataset, file, sessions, settings, caller, name, keyed)
    result: DatasetOut | JSONResponse = await anyio.to_thread.run_sync(store, limiter=request.app.state.upload_limiter)
    return result


def store_dataset(
    file: UploadFile, sessions: sessionmaker[Session], settings: Settings, caller: Caller, name: str | None,
    keyed: Idempotency | None = None,
) -> DatasetOut | JSONResponse:
    """Copy, check and hash the upload into the caller's folder and record it (blocking). With ``keyed``
    (an Idempotency-Key), the first answer to that key when there is one (api/idempotency.py)."""
    dataset_id = new_id()
    filename = file.filename or "upload"
    if "\x00" in filename:  # checked before anything is written: the row's name would be the filename
        raise Problem(
            422,
            "file: the file name must not contain the NUL character (\\u0000)",
            errors=[{"field": "file", "message": "the file name must not contain the NUL character"}],
        )
    limit_bytes = settings.max_upload_mb * (1 << 20)
    if keyed is not None:  # the upload is hashed only when there is a stored request to compare it with
        with sessions() as session:
            answer = keyed.answer(
                session.connection(),
                lambda: upload_fingerprint(name, filename, copy_limited(file.file, None, limit_bytes)[0]),
            )
        if answer is not None:
            return answer
        file.file.seek(0)
    store, prefix = DataStore.of(settings), dataset_prefix(caller.owner, dataset_id)
    stored = save_upload(file.file, filename, store, prefix, limit_bytes, settings.home.resolve() / "tmp")
    row = Dataset(
        id=dataset_id,
        owner=caller.owner,
        name=name or filename,
        format=stored.format,
        content_hash=stored.content_hash,
        size_bytes=stored.size_bytes,
        storage_path=stored.storage_path,
    )
    with sessions() as session:
        session.add(row)
        session.flush()
        out = DatasetOut.from_row(row)
        if keyed is not None:
            request = upload_fingerprint(name, filename, stored.content_hash)
            try:
                keyed.record(session.connection(), request, status.HTTP_201_CREATED, out.model_dump(mode="json"))
            except KeyTaken:
                session.rollback()
                store.remove(prefix)  # the files of the upload that lost the race to this key
                return keyed.after_race(session.connection(), request)
        session.commit()
    exit_if_asked()  # a testing aid: the API dies between its commit and its answer
    return out


def upload_fingerprint(name: str | None, filename: str, content_hash: str) -> str:
    """What makes two uploads the same request (api/idempotency.py): the name, file name and content."""
    return fingerprint("POST", "/v1/datasets", {"name": name, "filename": filename, "sha256": content_hash})


@router.get("", response_model=DatasetList)
def list_datasets(session: SessionDep, caller: CallerDep) -> DatasetList:
    """The caller's datasets (an admin's: everyone's), newest first."""
    query = select(Dataset).order_by(Dataset.created_at.desc(), Dataset.id.desc())
    if not caller.is_admin:
        query = query.where(Dataset.owner == caller.owner)
    return DatasetList(items=[DatasetOut.from_row(row) for row in session.execute(query).scalars()])


@router.get("/{dataset_id}", response_model=DatasetOut)
def get_dataset(dataset_id: str, session: SessionDep, caller: CallerDep) -> DatasetOut:
    return DatasetOut.from_row(owned_dataset(session, dataset_id, caller))
