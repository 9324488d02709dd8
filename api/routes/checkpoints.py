"""A job's checkpoints: ``GET /v1/jobs/{id}/checkpoints`` lists them with the metrics at their step,
``GET /v1/jobs/{id}/checkpoints/{step}.zip`` downloads one as a loadable model.

Checkpoints are read where they are (service_core/checkpoints.py: the object store's, else the
artifacts root's own folders); their metrics come from the job's stored metric points, so a
checkpoint's loss is exactly the point the metrics endpoint shows at that step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from fastapi import APIRouter, Path, Query
from fastapi.responses import StreamingResponse
from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from api.deps import ArtifactsDep, OwnedJob, SessionDep, SettingsDep
from api.problems import Problem
from api.routes.downloads import zip_stream
from api.schemas.common import MAX_INT64, problem_responses
from api.schemas.jobs import CheckpointList, CheckpointOut
from service_core.checkpoints import OPTIMIZER_PREFIX, StoredCheckpoint, job_checkpoints
from service_core.db.models import Job, MetricPoint
from trainer_core.checkpoint import CHECKPOINT_PREFIX
from trainer_core.spec import TrainingSpec

router = APIRouter(prefix="/v1/jobs", tags=["checkpoints"], responses=problem_responses(401, 404, 422))

LOSS = "loss"


@dataclass
class _Evaluation:
    step: int
    values: dict[str, float | None] = field(default_factory=dict)


def _points(session: Session, job_id: str) -> tuple[list[tuple[int, float | None, float | None]], list[_Evaluation]]:
    """The job's training-loss points (step, epoch, value) and its evaluations, in ``seq`` order."""
    rows = session.execute(
        select(MetricPoint.seq, MetricPoint.step, MetricPoint.epoch, MetricPoint.name, MetricPoint.value)
        .where(MetricPoint.job_id == job_id)
        .where(or_(MetricPoint.name == LOSS, MetricPoint.name.startswith("eval_", autoescape=True)))
        .order_by(MetricPoint.seq, MetricPoint.name)
    ).all()
    losses: list[tuple[int, float | None, float | None]] = []
    evaluations: dict[int, _Evaluation] = {}  # by seq: the values of one eval event share it
    for seq, step, epoch, name, value in rows:
        if name == LOSS:
            losses.append((step, epoch, value))
        else:
            evaluations.setdefault(seq, _Evaluation(step)).values[name] = value
    return losses, list(evaluations.values())


def checkpoint_list(session: Session, job: Job, found: list[StoredCheckpoint]) -> CheckpointList:
    """Each checkpoint with the newest loss and evaluation at or before its step, best and retention."""
    losses, evaluations = _points(session, job.id)
    # The stored spec's training section, read by the run's own rules (trainer_core/spec.py).
    training = TrainingSpec.model_validate(job.spec.get("training") or {})
    metric, greater, limit = training.best_metric, training.best_higher_is_better, training.save_total_limit
    items = []
    for index, ckpt in enumerate(found):
        loss = next((p for p in reversed(losses) if p[0] <= ckpt.step), None)
        evaluation = next((e for e in reversed(evaluations) if e.step <= ckpt.step), None)
        items.append(
            CheckpointOut(
                step=ckpt.step, epoch=loss[1] if loss else None, loss=loss[2] if loss else None,
                eval_step=evaluation.step if evaluation else None,
                eval_metrics=evaluation.values if evaluation else {},
                size=ckpt.size, created_at=ckpt.taken_at, is_best=False,
                kept=limit is None or index >= len(found) - limit,
                download_url=f"/v1/jobs/{job.id}/checkpoints/{ckpt.step}.zip",
            )
        )  # fmt: skip
    # As the run decides (trainer_core/best_checkpoint.py): a checkpoint evaluated at its own step is a
    # candidate; ties keep the earlier one. Retention keeps the newest `limit` and, when asked, the best.
    scored = [item for item in items if item.eval_step == item.step and item.eval_metrics.get(metric) is not None]
    if scored:
        sign = -1.0 if greater else 1.0
        best = min(scored, key=lambda item: (sign * float(item.eval_metrics[metric] or 0.0), item.step))
        best.is_best = True
        best.kept = best.kept or training.keeps_best
    return CheckpointList(items=items, best_metric=metric, greater_is_better=greater, save_total_limit=limit)


@router.get("/{job_id}/checkpoints", response_model=CheckpointList)
def list_checkpoints(job: OwnedJob, session: SessionDep, settings: SettingsDep) -> CheckpointList:
    """Every complete checkpoint of the job, oldest first; empty until the run saves one."""
    return checkpoint_list(session, job, list(job_checkpoints(settings.artifacts_root, job.id).values()))


@router.get(
    "/{job_id}/checkpoints/{step}.zip",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/zip": {}}}},
)
def download_checkpoint(
    job: OwnedJob,
    step: Annotated[int, Path(ge=0, le=MAX_INT64, description="The checkpoint's step, as listed.")],
    settings: SettingsDep,
    store: ArtifactsDep,
    with_optimizer: Annotated[bool, Query(description="Include the optimizer state (to resume training).")] = False,
) -> StreamingResponse:
    """One checkpoint as a zip holding ``checkpoint-<step>/``: a model (or adapter) and its tokenizer that
    ``from_pretrained`` loads, without the optimizer state unless ``with_optimizer``."""
    ckpt = job_checkpoints(settings.artifacts_root, job.id).get(step)
    if ckpt is None:
        message = f"job {job.id} has no complete checkpoint at step {step}"
        raise Problem(404, message, errors=[{"field": "step", "message": message}])
    # Weights, config, tokenizer and the small scheduler/RNG files; the optimizer state only when asked.
    files = [e.path for e in ckpt.files if with_optimizer or not e.path.startswith(OPTIMIZER_PREFIX)]
    name = f"{CHECKPOINT_PREFIX}{step}"
    paths, names = [f"{ckpt.folder}/{path}" for path in files], [f"{name}/{path}" for path in files]
    headers = {"Content-Disposition": f'attachment; filename="{job.id}-{name}.zip"'}
    return StreamingResponse(zip_stream(store, job.id, paths, names), media_type="application/zip", headers=headers)
