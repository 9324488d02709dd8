"""Typed dependencies: routes ask for ``SessionDep``, ``CallerDep`` or ``SettingsDep`` and never
build sessions, settings or clients by hand.

The app owns its settings, engine and artifact store (``app.state``, set by ``create_app``), so tests
can run several apps on different databases in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from api.artifacts import ArtifactStore
from api.auth import Caller, authenticate
from api.db.models import Dataset, Job
from api.problems import Problem, validation_problem
from api.settings import Settings
from trainer_core.spec import FieldError

# enqueue(job_id, queue, priority, settings): the worker's `enqueue_job` signature.
Enqueuer = Callable[[str, str, int, Settings], None]


def get_app_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_sessionmaker_for(request: Request) -> sessionmaker[Session]:
    maker: sessionmaker[Session] = request.app.state.sessionmaker
    return maker


def get_db(request: Request) -> Iterator[Session]:
    """One session per request; routes commit explicitly, anything left uncommitted is rolled back."""
    with get_sessionmaker_for(request)() as session:
        yield session


def get_artifact_store(request: Request) -> ArtifactStore:
    store: ArtifactStore = request.app.state.artifacts
    return store


def get_enqueuer(request: Request) -> Enqueuer:
    """The worker's ``enqueue_job``, imported on first use so the API starts without loading Celery."""
    enqueue: Enqueuer | None = getattr(request.app.state, "enqueue", None)
    if enqueue is None:
        from worker.celery_app import enqueue_job

        enqueue = request.app.state.enqueue = enqueue_job
    return enqueue


SettingsDep = Annotated[Settings, Depends(get_app_settings)]
# scope="function": the session closes when the route returns, so a streamed response (SSE,
# downloads) never holds a connection or an open transaction while it streams.
SessionDep = Annotated[Session, Depends(get_db, scope="function")]
ArtifactsDep = Annotated[ArtifactStore, Depends(get_artifact_store)]
EnqueueDep = Annotated[Enqueuer, Depends(get_enqueuer)]

bearer_scheme = HTTPBearer(auto_error=False, description="An API key from `trainjobs keys create`.")
_CHALLENGE = {"WWW-Authenticate": 'Bearer realm="trainjobs"'}


def get_caller(
    session: SessionDep,
    settings: SettingsDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)],
) -> Caller:
    """The caller behind ``Authorization: Bearer <key>``; 401 problem when missing or wrong."""
    if credentials is None or not credentials.credentials:
        raise Problem(401, "send `Authorization: Bearer <api key>`", headers=_CHALLENGE)
    caller = authenticate(session, credentials.credentials, settings.secret_key)
    session.rollback()  # end the read transaction: the route may run long (SSE) or use its own
    if caller is None:
        raise Problem(401, "the API key is unknown or revoked", headers=_CHALLENGE)
    return caller


CallerDep = Annotated[Caller, Depends(get_caller)]


def owned_job(session: Session, job_id: str, caller: Caller) -> Job:
    """The job if it exists and the caller may see it; another owner's job is a 404 like a missing one."""
    job = session.get(Job, job_id)
    if job is None or not (caller.is_admin or job.owner == caller.owner):
        raise Problem(404, f"no job {job_id!r}")
    return job


def get_owned_job(job_id: str, session: SessionDep, caller: CallerDep) -> Job:
    return owned_job(session, job_id, caller)


def owned_dataset(session: Session, dataset_id: str, caller: Caller, *, field: str | None = None) -> Dataset:
    """The dataset if the caller may use it; ``field`` turns "not found" into a 422 naming it."""
    dataset = session.execute(select(Dataset).where(Dataset.id == dataset_id)).scalar_one_or_none()
    if dataset is None or not (caller.is_admin or dataset.owner == caller.owner):
        if field is not None:
            raise validation_problem([FieldError(field, f"no dataset {dataset_id!r}", "not_found")])
        raise Problem(404, f"no dataset {dataset_id!r}")
    return dataset


OwnedJob = Annotated[Job, Depends(get_owned_job)]
