"""The memory estimator as the API uses it: estimates for jobs, and the budget check on submit.

``trainer_core.memory`` loads torch and transformers configs, so it is imported on first use; the
routes call this inside ``run_in_threadpool``, so the event loop stays free while the estimator works
(a model's first estimate builds it on the meta device).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from api.problems import Problem
from service_core.db import Job
from service_core.db.models import live_workers
from service_core.settings import Settings
from service_core.status import JobStatus
from trainer_core.auto import Budget
from trainer_core.memory_overhead import overhead_mb_to_bytes
from trainer_core.spec import FieldError, JobSpec, liger_refusal

logger = logging.getLogger(__name__)


def overhead_bytes(settings: Settings) -> int | None:
    """The overhead setting in bytes, or None to let the estimator read the same variable itself."""
    return None if settings.memory_overhead_mb is None else overhead_mb_to_bytes(settings.memory_overhead_mb)


def estimate(
    spec: JobSpec, settings: Settings, *, gpu_memory_gb: float | None = None, devices: int | None = None
) -> Any:
    """The estimator's MemoryEstimate (raises UnknownModelError, a SpecError, for models it cannot size)."""
    from trainer_core.memory import estimate_memory

    return estimate_memory(spec, devices=devices, gpu_memory_gb=gpu_memory_gb, overhead_bytes=overhead_bytes(settings))


def plan(spec: JobSpec, gpu_memory_gb: float, *, devices: int | None = None, max_nodes: int = 1) -> Any:
    from trainer_core.memory import plan_memory

    return plan_memory(spec, gpu_memory_gb, devices=devices, max_nodes=max_nodes)


def queue_workers(queue: str, settings: Settings, sessions: sessionmaker[Session]) -> int:
    """Live workers serving ``queue``: the nodes a job of it may span (worker/gang.py takes one slot each)."""
    with sessions() as session:
        return len(live_workers(session, settings.lease_seconds, queue))


def budget_for(spec: JobSpec, queue: str, settings: Settings) -> float | None:
    """The tightest per-device budget that applies: the spec's own and the queue's, when set."""
    budgets = [b for b in (spec.resources.gpu_memory_gb, settings.queue_budgets.get(queue)) if b is not None]
    return min(budgets) if budgets else None


def auto_budget(spec: JobSpec, queue: str, settings: Settings, sessions: sessionmaker[Session]) -> Budget:
    """The memory an ``auto`` micro-batch must fit: the queue's budget or ``resources.gpu_memory_gb``
    (the tighter), else the smallest device the queue's live workers report, else this host's own."""
    from trainer_core.auto import device_budget

    set_budget = budget_for(spec, queue, settings)
    if set_budget is not None:
        source = "resources.gpu_memory_gb" if spec.resources.gpu_memory_gb == set_budget else f"queue {queue}'s budget"
        return Budget(set_budget, source)
    devices = live_devices(queue, settings, sessions)
    if devices:
        gb, kind = min(devices)
        where = "GPU memory" if kind == "gpu" else "share of host memory for a CPU run"
        return Budget(gb, f"the {where} of queue {queue}'s smallest worker", cpu=kind == "cpu")
    here = device_budget()
    return Budget(here.gb, f"{here.source}; no worker of queue {queue} has reported", cpu=here.cpu)


def live_devices(queue: str, settings: Settings, sessions: sessionmaker[Session]) -> list[tuple[float, str | None]]:
    """``(memory GB, "gpu" or "cpu")`` of each live worker of ``queue`` that reported its device."""
    with sessions() as session:
        rows = live_workers(session, settings.lease_seconds, queue)
    return [(row.device_memory_gb, row.device_kind) for row in rows if row.device_memory_gb is not None]


def liger_errors(spec: JobSpec, queue: str, settings: Settings, sessions: sessionmaker[Session]) -> list[FieldError]:
    """``efficiency.liger`` where nothing trains on CUDA: the queue's device (``TRAINJOBS_QUEUE_DEVICES``)
    is not a GPU, or none is set and no live worker of the queue reports a GPU."""
    if not spec.efficiency.liger:
        return []
    named = settings.queue_devices.get(queue)
    if named is not None and named != "cpu":
        return []
    if named is None and any(kind == "gpu" for _, kind in live_devices(queue, settings, sessions)):
        return []
    where = f"queue {queue!r} trains on the CPU" if named == "cpu" else f"no worker of queue {queue!r} has a GPU"
    return [liger_refusal(where)]


def multi_node_errors(spec: JobSpec, queue: str, settings: Settings, sessions: sessionmaker[Session]
                      ) -> list[FieldError]:  # fmt: skip
    """What keeps a job of several nodes (worker/gang.py) from running on ``queue``: fewer live workers
    than nodes (a gang takes one slot on each of N workers)."""
    nodes = spec.resources.num_nodes
    if nodes <= 1:
        return []
    workers = queue_workers(queue, settings, sessions)
    if workers >= nodes:
        return []
    return [FieldError("resources.num_nodes", f"a job of {nodes} nodes takes a slot on each of {nodes} workers of "
                       f"queue {queue!r}, which has {workers} live; start `trainjobs worker --queue {queue}` on "
                       f"{nodes} machines, or use fewer nodes")]  # fmt: skip


def resolve_auto_for_submit(
    spec: JobSpec, here: JobSpec, queue: str, train_rows: int | None, settings: Settings,
    sessions: sessionmaker[Session],
) -> tuple[JobSpec, JobSpec, list[dict[str, Any]]]:
    """``spec`` and its readable copy ``here`` with their ``auto`` values chosen (sized on ``here``),
    and the choices; both unchanged, with no choices, when the spec asks for none."""
    from trainer_core.auto import apply_choices, resolve_auto

    if not here.training.auto:
        return spec, here, []
    sized = "per_device_train_batch_size" in here.training.auto
    budget = auto_budget(here, queue, settings, sessions) if sized else None
    here, choices = resolve_auto(here, budget=budget, train_rows=train_rows, overhead_bytes=overhead_bytes(settings))
    return apply_choices(spec, choices), here, [choice.as_dict() for choice in choices]


def estimate_for_submit(
    spec: JobSpec, queue: str, settings: Settings, sessions: sessionmaker[Session] | None = None
) -> dict[str, Any] | None:
    """The estimate to store with a job; a 422 with the planner's advice when it exceeds the budget.

    Without a budget an unknown model is not an error (the worker may still fetch it); with one,
    the job cannot be checked, so the estimator's error (naming ``model.name_or_path``) stands.
    """
    from trainer_core.memory import UnknownModelError

    budget = budget_for(spec, queue, settings)
    try:
        result = estimate(spec, settings, gpu_memory_gb=budget)
    except UnknownModelError:
        if budget is not None:
            raise
        logger.info("no memory estimate for job %r: model unknown to the estimator", spec.name)
        return None
    body: dict[str, Any] = result.model_dump(mode="json")
    if budget is not None and not result.fits:
        # a full fine-tune may be offered sharded over as many machines as the queue has workers
        nodes = queue_workers(queue, settings, sessions) if sessions is not None else 1
        advice = plan(spec, budget, max_nodes=max(1, nodes)).model_dump(mode="json")
        field = "resources.gpu_memory_gb" if spec.resources.gpu_memory_gb == budget else "queue"
        message = f"the estimate exceeds the {budget:g} GB budget"
        detail = over_budget_advice(advice)
        copy = reference_copy_advice(spec, result, budget, settings, advice)
        if copy is not None:  # it fits but for DPO's frozen reference copy: name the field that keeps it
            field, (message, detail) = "preference.reference", copy
        raise Problem(
            422,
            f"the job needs about {gib(result.total_bytes)} per device, over the {budget:g} GB budget; " + detail,
            title="Job does not fit in GPU memory",
            type_="urn:trainjobs:problem:over-budget",
            errors=[{"field": field, "message": message, "type": "over_budget"}],
            estimate=body,
            plan=advice,
            budget_gb=budget,
        )
    return body


def reference_copy_advice(
    spec: JobSpec, result: Any, budget: float, settings: Settings, advice: dict[str, Any]
) -> tuple[str, str] | None:
    """(error message, advice) when a DPO job keeping a frozen reference copy (``reference: base``) fits
    ``budget`` with ``reference: precomputed``; else None. The advice names the precomputed estimate
    and the planner's first adapter entry, if it has one."""
    from trainer_core.memory.planner import PRECOMPUTED_REFERENCE, apply_changes

    if not result.reference_weight_bytes:
        return None
    precomputed = estimate(apply_changes(spec, PRECOMPUTED_REFERENCE), settings, gpu_memory_gb=budget)
    if not precomputed.fits:
        return None
    message = (
        f"reference 'base' keeps a frozen copy of the starting weights ({gib(result.reference_weight_bytes)}) "
        f"and scores it every step; the {budget:g} GB budget cannot hold it"
    )
    text = (
        f"{message}. With preference.reference=precomputed (the reference log-probs scored once before training) "
        f"it needs {gib(precomputed.total_bytes)}"
    )
    adapters = [e for e in advice["entries"] if "adapter" in e["changes"]]
    if adapters:
        first = adapters[0]
        text += f"; or train an adapter: {changes_text(first['changes'])} ({gib(first['estimate_total_bytes'])})"
    entries = advice["entries"]
    if entries and not {"adapter", "preference.reference"} & entries[0]["changes"].keys():  # other settings hold it
        text += "; " + over_budget_advice(advice)
    return message, text


def gib(size: int) -> str:
    return f"{size / (1 << 30):.2f} GiB"


def changes_text(changes: dict[str, Any]) -> str:
    """``a.b=1, c=2`` (or ``no change``) for a plan's changes to the spec."""
    return ", ".join(f"{k}={v}" for k, v in changes.items()) or "no change"


def over_budget_advice(plan_body: dict[str, Any]) -> str:
    """What the planner found, truthfully: the first configuration that fits, or that none does and
    the smallest footprint it found, with the settings that reach it."""
    entries = plan_body["entries"]
    if entries:
        first = entries[0]
        return (
            f"`plan` lists {len(entries)} configuration(s) that fit, the first: {changes_text(first['changes'])} "
            f"({gib(first['estimate_total_bytes'])})"
        )
    return (
        f"nothing the planner tried fits; the smallest footprint found is {gib(plan_body['minimum_total_bytes'])} "
        f"with {changes_text(plan_body['minimum_changes'])}; use a queue with more memory or a smaller model"
    )


# A queue's history of finished jobs changes slowly: read it at most once a minute per API process
# (keyed by database and queue).
HISTORY_TTL_S = 60.0
_history: dict[tuple[str, str, str | None], tuple[float, list[Any]]] = {}
_history_lock = threading.Lock()


def queue_history(sessions: sessionmaker[Session], queue: str, family: str | None = None) -> list[Any]:
    """The queue's newest succeeded jobs as time observations (oldest first): the work each was
    counted to do, scaled to the samples it trained, over the seconds it trained; with ``family``, only
    the jobs of that model family (``model_type``)."""
    from trainer_core.time_estimate import HISTORY, Observation

    now, key = time.monotonic(), (str(sessions.kw.get("bind")), queue, family)
    with _history_lock:
        cached = _history.get(key)
    if cached is not None and now - cached[0] < HISTORY_TTL_S:
        return cached[1]
    with sessions() as session:
        # ix_jobs_status_created serves this (newest succeeded first).
        rows = session.execute(
            select(Job.estimate, Job.final_metrics)
            .where(Job.status == JobStatus.succeeded.value, Job.queue == queue)
            .order_by(Job.created_at.desc(), Job.id.desc())
            .limit(10 * HISTORY)
        ).all()
    observations = []
    for est, final in rows:
        counted = (est or {}).get("time")
        if not counted or not final or (family is not None and counted.get("family") != family):
            continue
        samples, seconds = final.get("train_samples"), final.get("train_runtime_s")
        if not samples or not seconds or not counted.get("train_samples"):
            continue
        share = samples / counted["train_samples"]  # a resumed run reports its last session only
        work = (counted["train_flops"] + counted["eval_flops"]) * share
        observations.append(Observation(work, float(seconds), steps=(counted.get("steps") or 0) * share))
        if len(observations) == HISTORY:
            break
    observations.reverse()
    with _history_lock:
        _history[key] = (now, observations)
    return observations


def time_estimate(
    spec: JobSpec, queue: str, train_rows: int | None, eval_rows: int, settings: Settings,
    sessions: sessionmaker[Session], sample_tokens: dict[str, Any] | None = None,
) -> dict[str, Any] | None:  # fmt: skip
    """The time part of a job's estimate (issue 29): its counted work, and the seconds it will take on
    its queue's device at the efficiency the queue's finished jobs showed; None when the model's work
    is not modelled (conv nets, audio) or the data's rows are unknown (preflight's count at submit,
    ``train_rows`` in an estimate request). ``sample_tokens``: preflight's measured positions a sample
    and samples a row (trainer_core/token_lengths.py); without it a sample is ``max_length`` long."""
    from trainer_core.flops import NotModelled, TrainingFlops, run_samples, sample_flops
    from trainer_core.memory.parameters import model_structure
    from trainer_core.time_estimate import MIN_JOBS, calibrate, device_peak, predict_seconds

    if not train_rows:
        return None
    try:
        # The structure the memory estimate built (cached; its head has the config's label count,
        # which moves the count by a head's few multiply-adds a sample).
        structure = model_structure(spec.model, spec.task)
        tokens = round(sample_tokens["tokens"]) if sample_tokens else None
        sample = sample_flops(structure, spec, tokens)
    except NotModelled as exc:
        logger.info("no time estimate for job %r: %s", spec.name, exc)
        return None
    except (TypeError, ValueError):  # a config without the sizes the count reads: no time part, no 500
        logger.warning("no time estimate for job %r: its model's sizes could not be read", spec.name, exc_info=True)
        return None
    if sample_tokens:  # packed rows: fewer samples than rows (the eval split is packed the same way)
        per_row = float(sample_tokens["samples_per_row"])
        train_rows, eval_rows = max(1, math.ceil(train_rows * per_row)), math.ceil(eval_rows * per_row)
    steps, samples, eval_samples = run_samples(spec, train_rows, eval_rows, spec.world_size)
    device = settings.queue_devices.get(queue)
    dtype = {"bf16": "bf16", "fp16": "fp16"}.get(spec.efficiency.mixed_precision, "fp32")
    # Without a device the rate itself is learned (a peak of 1 FLOP/s makes the efficiency the rate).
    peak = device_peak(device, dtype) * spec.world_size if device else 1.0  # type: ignore[arg-type]
    # The model family's own history where it has enough jobs (its step overhead and efficiency are
    # its own: a BERT and a Llama of one size differ), else the whole queue's.
    family = structure.model_type
    history = queue_history(sessions, queue, family)
    scope = f"model family {family}"
    if len(history) < MIN_JOBS:
        history, scope = queue_history(sessions, queue), "queue"
    calibration = calibrate(history, peak)
    # DPO's precomputed reference scores each row of both splits once, before training.
    work = TrainingFlops(sample, samples, eval_samples, train_rows, eval_rows)
    train_flops, eval_flops = work.train, work.eval
    body: dict[str, Any] = {
        "device": device, "dtype": dtype, "peak_flops": peak if device else None,
        "tokens_per_sample": sample.tokens, "tokens_measured": bool(sample_tokens),
        "steps": steps, "train_samples": samples, "eval_samples": eval_samples,
        "family": structure.model_type, "flops_per_train_sample": sample.train, "flops_per_eval_sample": sample.forward,
        "train_flops": train_flops, "eval_flops": eval_flops, "formula": sample.formula,
        "calibration": {"jobs": calibration.jobs, "calibrated": calibration.calibrated,
                        "efficiency": calibration.efficiency if device else None, "spread": calibration.spread,
                        "overhead_s_per_step": calibration.overhead_s, "scope": scope},
    }  # fmt: skip
    if not calibration.calibrated and not device:
        body["seconds"] = None
        body["note"] = (f"uncalibrated: queue {queue!r} has fewer finished jobs than needed and no device in "
                        "TRAINJOBS_QUEUE_DEVICES")  # fmt: skip
        return body
    predicted = predict_seconds(train_flops + eval_flops, peak, calibration, steps=steps)
    rate = peak * calibration.efficiency
    train_seconds = steps * calibration.overhead_s + train_flops / rate
    body |= {
        "seconds": predicted.seconds, "seconds_p10": predicted.low, "seconds_p90": predicted.high,
        "train_seconds": train_seconds, "eval_seconds": eval_flops / rate,
        "samples_per_second": samples / train_seconds if train_seconds else None,
        "tokens_per_second": samples / train_seconds * sample.tokens if train_seconds else None,
    }  # fmt: skip
    if not calibration.calibrated:
        body["note"] = f"uncalibrated: the prior efficiency, until queue {queue!r} has finished jobs to learn from"
    return body


def with_cost(time_body: dict[str, Any] | None, spec: JobSpec, queue: str, settings: Settings) -> dict[str, Any] | None:
    """The time part with what it costs: predicted device-hours, the queue's price and their product."""
    from service_core.usage import cost_of, device_hours

    if time_body is None:
        return None
    price = settings.queue_prices.get(queue)
    seconds = time_body.get("seconds")
    hours = None if seconds is None else device_hours(seconds, spec.world_size)
    return time_body | {
        "devices": spec.world_size,
        "device_hours": hours,
        "price_per_device_hour": price,
        "cost": None if hours is None else cost_of(hours, price),
    }


def check_monthly_budget(
    owner: str, estimate: dict[str, Any] | None, spec: JobSpec, settings: Settings, sessions: sessionmaker[Session]
) -> None:
    """A 429 when the owner's monthly device-hours (TRAINJOBS_OWNER_MONTHLY_DEVICE_HOURS) cannot hold
    this job's prediction beside what its jobs spent and reserved this month. A job the time model
    cannot predict is let through: there is nothing to hold it against until it has run."""
    from service_core.usage import committed_hours, monthly_budget, predicted_device_hours

    budget = monthly_budget(settings.owner_monthly_device_hours, owner)
    predicted = predicted_device_hours(estimate, spec.world_size)
    if budget is None or predicted is None:
        return
    with sessions() as session:
        committed = committed_hours(session, owner)
    left = max(0.0, budget - committed)
    if predicted <= left:
        return
    raise Problem(
        429,
        f"the job is predicted to take {predicted:.3g} device-hours, and {owner}'s monthly budget of {budget:g} "
        f"device-hours (TRAINJOBS_OWNER_MONTHLY_DEVICE_HOURS) has {left:.3g} left ({committed:.3g} spent or "
        "reserved by jobs this month); shorten the job, wait for the next month, or ask an admin for more",
        title="Monthly device-hour budget exceeded",
        type_="urn:trainjobs:problem:monthly-budget",
        errors=[{"field": "budget", "message": f"{predicted:.3g} device-hours over {left:.3g} left", "type": "budget"}],
        budget_device_hours=budget,
        committed_device_hours=committed,
        left_device_hours=left,
        predicted_device_hours=predicted,
    )
