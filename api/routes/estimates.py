"""Memory estimates before submitting, and the catalog of models the estimator knows offline."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from api.deps import CallerDep, SessionFactoryDep, SettingsDep, get_app_settings, get_session_factory
from api.estimation import auto_budget, estimate, overhead_bytes, plan, queue_workers, time_estimate, with_cost
from api.fast_path import FastPath
from api.paths import check_spec_locations, readable_here
from api.problems import Problem
from api.schemas.common import problem_responses
from api.schemas.estimates import Catalog, EstimateRequest, EstimateResponse
from api.schemas.preflight import AutoChoiceOut
from service_core.keys import Caller
from service_core.settings import Settings
from trainer_core.spec import JobSpec

router = APIRouter(prefix="/v1", tags=["estimates"], responses=problem_responses(401, 404, 422))


def estimate_response(
    body: EstimateRequest, settings: Settings, sessions: sessionmaker[Session] | None = None
) -> EstimateResponse:
    """The estimator's answer for ``body`` (blocking: a model's first estimate builds it on the meta
    device); with ``train_rows`` (and ``sessions``, for the queue's history) also the time part."""
    from trainer_core.auto import AutoChoice, Budget, device_budget, resolve_auto
    from trainer_core.memory import TOTAL_FORMULA

    queue = body.queue or settings.default_queue
    choices: list[AutoChoice] = []
    if body.spec.training.auto:  # estimated as submit would choose them (the rows: train_rows, if given)
        if body.gpu_memory_gb is not None:
            budget = Budget(body.gpu_memory_gb, "the request's gpu_memory_gb")
        else:
            budget = auto_budget(body.spec, queue, settings, sessions) if sessions is not None else device_budget()
        spec, choices = resolve_auto(body.spec, budget=budget, train_rows=body.train_rows,
                                     overhead_bytes=overhead_bytes(settings), partial=True)  # fmt: skip
        body = body.model_copy(update={"spec": spec})
    result = estimate(body.spec, settings, gpu_memory_gb=body.gpu_memory_gb, devices=body.devices)
    advice = None
    if body.gpu_memory_gb is not None:
        # over more machines too, as many as the queue has live workers (a job of several nodes takes one each)
        nodes = queue_workers(queue, settings, sessions) if sessions is not None and body.devices is None else 1
        advice = plan(body.spec, body.gpu_memory_gb, devices=body.devices, max_nodes=max(1, nodes))
        advice = advice.model_dump(mode="json")
    # total_formula: so a client without torch renders the same table as `trainjobs estimate`.
    answer = {**result.model_dump(mode="json"), "total_formula": TOTAL_FORMULA}
    if body.train_rows is not None and sessions is not None:
        answer["time"] = with_cost(
            time_estimate(body.spec, queue, body.train_rows, body.eval_rows, settings, sessions), body.spec, queue,
            settings,
        )
    auto = [AutoChoiceOut.model_validate(choice.as_dict()) for choice in choices] or None
    return EstimateResponse(estimate=answer, plan=advice, auto=auto)


@router.post("/estimates", response_model=EstimateResponse)
@router.post("/estimates/memory", response_model=EstimateResponse)  # the first name, kept working
async def estimate_memory(
    body: EstimateRequest, settings: SettingsDep, caller: CallerDep, sessions: SessionFactoryDep
) -> EstimateResponse:
    """The estimator's breakdown for a spec; with ``gpu_memory_gb``, also the planner's fitting list; with
    ``train_rows``, the time and cost on ``queue``. (`/v1/estimates/memory` is its first name.)

    A spec of the documented shape can still be a 422 naming the field: its model must be one the
    estimator can build, its local paths must lie under the data root, and cross-field rules hold
    (e.g. `efficiency.local_sgd_steps` needs `training.backend: accelerate`).
    """
    if body.gpu_memory_gb is None and body.train_rows is None and is_warm(body.spec):
        # A built model's estimate is ~0.05 ms of arithmetic: cheaper on the event loop than the
        # hand-off to a thread (and back) it would otherwise cost. (Warm means a config or catalog
        # model: no location to resolve.)
        return estimate_response(body, settings)
    # A model's first estimate builds it on the meta device (up to seconds), and the planner runs
    # many estimates: off the event loop. Locations resolve as at submit, so the spec a user is about
    # to submit (`models/...` under the data root) is estimated as the run will load it.
    owner = None if caller.is_admin else caller.owner
    return await run_in_threadpool(located_estimate, body, settings, owner, sessions)


async def _serve_estimate(
    request: Request, body: EstimateRequest, caller: Caller, _response: Response
) -> EstimateResponse:
    return await estimate_memory(body, await get_app_settings(request), caller, await get_session_factory(request))


# Both names of the route (api/fast_path.py: why, and which requests FastAPI's route serves instead)
FAST_PATHS = [FastPath("POST", path, EstimateRequest, EstimateResponse, _serve_estimate)
              for path in ("/v1/estimates", "/v1/estimates/memory")]  # fmt: skip


def located_estimate(
    body: EstimateRequest, settings: Settings, owner: str | None, sessions: sessionmaker[Session]
) -> EstimateResponse:
    located = readable_here(check_spec_locations(body.spec, settings.data_root_url, owner), settings)
    return estimate_response(body.model_copy(update={"spec": located}), settings, sessions)


def is_warm(spec: JobSpec) -> bool:
    """Whether the estimator has ``spec``'s model built already (only a config or catalog source:
    a local directory is re-checked on disk each time)."""
    from trainer_core.memory.catalog import in_catalog
    from trainer_core.memory.parameters import cached_structure

    if spec.model.config is None and not in_catalog(spec.model.name_or_path or ""):
        return False
    return cached_structure(spec.model, spec.task) is not None


@router.get("/models/catalog", response_model=Catalog)
def model_catalog(_caller: CallerDep) -> Catalog:
    """Models whose architecture the estimator knows without downloading anything."""
    from trainer_core.memory import catalog_entry, catalog_ids

    items: list[dict[str, Any]] = [{"id": model_id, **catalog_entry(model_id)} for model_id in catalog_ids()]
    return Catalog(items=items)


@router.get("/models/catalog/{model_id:path}", response_model=dict[str, Any])
def model_catalog_entry(model_id: str, _caller: CallerDep) -> dict[str, Any]:
    from trainer_core.memory import catalog_entry, catalog_ids

    if model_id not in catalog_ids():
        raise Problem(404, f"no model {model_id!r} in the catalog")
    return {"id": model_id, **catalog_entry(model_id)}
