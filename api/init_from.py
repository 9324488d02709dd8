"""``init_from`` at submit: the job and checkpoint a new job starts from, checked and pinned.

Every refusal is a 422 naming an ``init_from`` field, before anything is stored:

* a job that is not the caller's is answered exactly as one that does not exist (no leak);
* a checkpoint that does not exist (the message lists those that do);
* ``best`` or ``last`` of a job still going (its last may change, its best may not be saved yet): name a
  complete checkpoint by its step instead;
* another model than the job trained (the weights load only into the same architecture), or an
  adapter of another rank or targets (trainer_core/init_from.py's rule, which the run applies too);
* ``resume_optimizer`` where the optimizer or the trained parameters differ.

``best`` and ``last`` are resolved to a step here and stored as that step, so the job always starts
from the checkpoint the submit saw (the worker fetches it: worker/execute.py).
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from api.routes.checkpoints import checkpoint_list
from service_core.checkpoints import job_checkpoints
from service_core.db.models import Job
from service_core.keys import Caller
from service_core.settings import Settings
from service_core.status import JobStatus
from trainer_core.spec import FieldError, JobSpec, SpecError
from trainer_core.spec_init_from import adapter_mismatch


def _refuse(field: str, message: str, kind: str = "value_error") -> SpecError:
    return SpecError([FieldError(f"init_from.{field}", message, kind)])


def resolve_init_from(spec: JobSpec, sessions: sessionmaker[Session], settings: Settings, caller: Caller) -> JobSpec:
    """``spec`` with ``init_from.checkpoint`` pinned to a step of a job the caller may start from."""
    init = spec.init_from
    if init is None:
        return spec
    if init.path is not None:
        raise _refuse("path", "the service starts from a job's checkpoint: name init_from.job (and checkpoint)")
    assert init.job is not None  # InitFromSpec: a job or a path
    with sessions() as session:
        parent = session.get(Job, init.job)
        if parent is None or not (caller.is_admin or parent.owner == caller.owner):
            raise _refuse("job", f"no job {init.job!r}", "not_found")
        found = job_checkpoints(settings.artifacts_root, parent.id)
        steps = ", ".join(map(str, found)) or "none yet"
        status = JobStatus(parent.status)
        if isinstance(init.checkpoint, str) and not status.terminal:
            raise _refuse("checkpoint", f"job {parent.id} is {status.value}: its {init.checkpoint} checkpoint may "
                          f"still change; name a complete one by its step ({steps}) or wait for it to end")  # fmt: skip
        if not found:
            raise _refuse("checkpoint", f"job {parent.id} has no complete checkpoint (training.save_steps sets when "
                          "a run saves one)")  # fmt: skip
        if init.checkpoint == "last":
            step = max(found)
        elif init.checkpoint == "best":
            best = [item.step for item in checkpoint_list(session, parent, list(found.values())).items if item.is_best]
            if not best:
                raise _refuse("checkpoint", f"no checkpoint of job {parent.id} was evaluated at its own step, so "
                              f"none is best; name one by its step ({steps})")  # fmt: skip
            step = best[0]
        elif init.checkpoint in found:
            step = init.checkpoint
        else:
            raise _refuse("checkpoint", f"job {parent.id} has no complete checkpoint at step {init.checkpoint}; "
                          f"it has: {steps}")  # fmt: skip
        parent_spec = JobSpec.model_validate(parent.spec)
    _check_fits(spec, parent.id, parent_spec)
    return spec.model_copy(update={"init_from": init.model_copy(update={"checkpoint": step})})


def _model_of(spec: JobSpec) -> dict[str, Any]:
    """What decides the architecture and its starting weights (the tokenizer and processor do not)."""
    return spec.model.model_dump(include={"name_or_path", "config", "revision"})


def _check_fits(spec: JobSpec, parent_id: str, parent: JobSpec) -> None:
    assert spec.init_from is not None
    if _model_of(parent) != _model_of(spec):
        source = parent.model.name_or_path or f"a {parent.model.config and parent.model.config['model_type']} config"
        raise _refuse("job", f"job {parent_id} trained {source}; this spec's model differs, and a checkpoint's "
                      "weights load only into the model they were trained as (give the same `model`)")  # fmt: skip
    if parent.adapter is not None:
        held = {"r": parent.adapter.r, "target_modules": parent.adapter.target_modules}
        if (problem := adapter_mismatch(spec.adapter, held)) is not None:
            raise _refuse("job", f"job {parent_id}: {problem}")
    if spec.init_from.resume_optimizer:
        if parent.optimizer.name != spec.optimizer.name:
            raise _refuse("resume_optimizer", f"job {parent_id} used the optimizer {parent.optimizer.name!r}, this "
                          f"spec {spec.optimizer.name!r}: its state does not carry over")  # fmt: skip
        if (parent.adapter is None) != (spec.adapter is None) or parent.task != spec.task:
            raise _refuse("resume_optimizer", f"job {parent_id} trained other parameters (its task and adapter "
                          "differ from this spec's): its optimizer state does not fit")  # fmt: skip
