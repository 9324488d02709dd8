"""``train_job``: the one public entry to training, used by the CLI (so by every run the worker starts),
each torchrun rank, and library callers.

It validates what only a live machine can check, prepares data, picks the backend, and always ends
with a ``done`` event, whatever happened. Several processes are handed to :mod:`trainer_core.launch`.
"""

from __future__ import annotations

import importlib.util
import logging
import os
from pathlib import Path
from typing import Any

import torch

from trainer_core.checkpoint import newest_checkpoint, read_meta
from trainer_core.deadline import deadline_guard
from trainer_core.events import Event, EventSink, RunStatus, make_event
from trainer_core.failures import failure_reason, failure_summary
from trainer_core.init_from import init_source
from trainer_core.launch import Rendezvous
from trainer_core.nan_guard import nan_guard
from trainer_core.oom_fault import oom_fault
from trainer_core.path_guard import Reach, check_reach
from trainer_core.spec import FieldError, JobSpec, SpecError, untrainable_errors
from trainer_core.stopping import StopSignal
from trainer_core.trackers import TrackerRuns

logger = logging.getLogger(__name__)
# Re-exported: callers (the CLI, launch) know them as run.failure_reason/failure_summary.
__all__ = ["check_runnable", "failure_reason", "failure_summary", "train_job"]


def _discard(event: Event) -> None:
    """The sink of processes other than the main one: only rank 0 speaks."""


def is_distributed_rank() -> bool:
    """True inside a process that torchrun started as one rank of several."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


# report_to name -> the package its tracker needs, and what installs it
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
TRACKER_INSTALLS = {"tensorboard": "tensorboard", "wandb": "trainjobs[wandb]", "mlflow": "trainjobs[mlflow]"}


def check_runnable(spec: JobSpec) -> None:
    """Rules that depend on this machine rather than on the spec alone."""
    untrainable = untrainable_errors(spec, cuda=torch.cuda.is_available())
    if untrainable:
        raise SpecError(untrainable)
    if spec.efficiency.mixed_precision == "fp16" and not torch.cuda.is_available():
        raise SpecError(
            [FieldError("efficiency.mixed_precision", "fp16 needs a CUDA device; use 'bf16' on this machine")]
        )
    for i, tracker in enumerate(spec.training.report_to):
        if importlib.util.find_spec(TRACKER_PACKAGES[tracker]) is None:
            message = f"'{tracker}' is not installed on this machine (pip install '{TRACKER_INSTALLS[tracker]}')"
            raise SpecError([FieldError(f"training.report_to.{i}", message)])
    init_source(spec)  # the checkpoint `init_from` names exists and fits, before any data is read


def _reset_accelerate_state() -> None:
    # Accelerate keeps process-wide singletons; a second run in the same process (tests, notebooks)
    # with another mixed precision would otherwise be refused.
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _resume_point(spec: JobSpec, output_dir: Path, resume: bool) -> Path | None:
    if not resume:
        return None
    ckpt = newest_checkpoint(output_dir)
    if ckpt is None:
        logger.info("no checkpoint in %s: starting from scratch", output_dir)
        return None
    backend = read_meta(ckpt).get("backend")
    if backend != spec.training.backend:
        raise SpecError(
            [FieldError("training.backend", f"the checkpoint {ckpt.name} was written by the '{backend}' backend")]
        )
    return ckpt


def _train(
    spec: JobSpec, output_dir: Path, emit: EventSink, stop: StopSignal, resume: bool, cache_dir: Path | None,
    reach: Reach | None,
) -> tuple[RunStatus, dict[str, Any]]:
    from accelerate import PartialState

    from trainer_core.backends import RunContext, run_backend
    from trainer_core.backends.common import write_run_files
    from trainer_core.data import prepare_data

    # cpu=True is what makes accelerate treat torchrun processes on a CPU-only machine as one gloo group.
    state = PartialState(cpu=not torch.cuda.is_available())
    resume_from = _resume_point(spec, output_dir, resume)
    # Each location is checked again as it is opened (trainer_core/path_guard.py): the data, tokenizer and
    # processor now, the model once the data is ready (preprocessing may take long enough for a swap).
    check_reach(spec, reach)
    with state.main_process_first():  # rank 0 fills the preprocessing cache, the others reuse it
        data = prepare_data(spec, cache_dir)
    check_reach(spec, reach, ("model",))
    ctx = RunContext(spec=spec, output_dir=output_dir, data=data, emit=emit, stop=stop, resume_from=resume_from)
    result = run_backend(ctx)
    summary: dict[str, Any] = {
        "global_step": result.global_step,
        "eval": result.eval_metrics,
        "train": result.train,
        "cache_hit": data.cache_hit,
    }
    if result.status == "succeeded" and state.is_main_process:
        write_run_files(output_dir, spec, {"eval": result.eval_metrics, "train": result.train,
                                           "global_step": result.global_step})
    return result.status, summary


def resolve_auto_here(spec: JobSpec, sink: EventSink) -> JobSpec:
    """A spec with ``auto`` values run without the service (``trainjobs train``): chosen on this
    machine (the budget: ``resources.gpu_memory_gb``, else its device; the rows: the data's own), each
    choice said in a ``log`` event. The service resolves them at submit, so its runs never get here."""
    from trainer_core.auto import Budget, resolve_auto

    rows = None
    if "num_train_epochs" in spec.training.auto:
        from trainer_core.preflight import preflight

        rows = preflight(spec).train_rows  # raises PreflightError, a SpecError naming the field
    budget = Budget(spec.resources.gpu_memory_gb, "resources.gpu_memory_gb") if spec.resources.gpu_memory_gb else None
    resolved, choices = resolve_auto(spec, budget=budget, train_rows=rows)
    for choice in choices:
        sink(make_event("log", message=f"auto: {choice.field} = {choice.value} ({choice.why})"))
    return resolved


def train_job(
    spec: JobSpec,
    output_dir: Path,
    *,
    emit: EventSink | None = None,
    resume: bool = False,
    stop_file: Path | None = None,
    cache_dir: Path | None = None,
    reach: Reach | None = None,
    rendezvous: Rendezvous | None = None,
) -> RunStatus:
    """Train ``spec`` into ``output_dir`` and return how it ended; always emits a final ``done`` event.

    ``rendezvous``: where a job of several nodes meets (each node calls this with the same one).

    Raises :class:`SpecError` (after the ``done`` event) for a spec this machine cannot run, so the
    CLI can name the field; every other failure is reported as status ``failed`` with a reason.
    ``reach``: the local paths the run may read (a service's run; None: any).
    """
    sink = emit or _discard
    output_dir = Path(output_dir)
    try:
        check_runnable(spec)
        if spec.resources.num_nodes > 1 and rendezvous is None and not is_distributed_rank():
            raise SpecError([FieldError(
                "resources.num_nodes", "a job of several nodes needs a rendezvous: start it on each node with the "
                "same --rdzv-endpoint HOST:PORT and --rdzv-id",
            )])  # fmt: skip
        if spec.training.auto and not is_distributed_rank():  # ranks get the launcher's resolved spec
            spec = resolve_auto_here(spec, sink)
    except SpecError as exc:
        sink(make_event("done", status="failed", summary=failure_summary(exc)))
        raise
    if is_distributed_rank():  # rank 0's events reach the launching process, whose trackers mirror them
        return _train_here(spec, output_dir, sink, resume, stop_file, cache_dir, reach)
    try:
        trackers = TrackerRuns(spec, output_dir, resume=resume)
    except Exception as exc:
        logger.exception("the trackers (training.report_to) did not start")
        sink(make_event("done", status="failed", summary=failure_summary(exc)))
        return "failed"
    with trackers:
        tracked = trackers.sink(sink)
        if spec.world_size > 1:
            from trainer_core.launch import run_distributed

            return run_distributed(
                spec, output_dir, emit=tracked, resume=resume, stop_file=stop_file, cache_dir=cache_dir, reach=reach,
                rendezvous=rendezvous,
            )
        return _train_here(spec, output_dir, tracked, resume, stop_file, cache_dir, reach)


def _train_here(
    spec: JobSpec, output_dir: Path, sink: EventSink, resume: bool, stop_file: Path | None, cache_dir: Path | None,
    reach: Reach | None,
) -> RunStatus:
    """Train in this process (the only one, or one torchrun rank); emits ``done`` through ``sink``."""
    main = int(os.environ.get("RANK", "0")) == 0
    guarded = deadline_guard(nan_guard(sink, spec.training.nan_patience), spec.resources.max_runtime_minutes)
    gated = guarded if main else _discard
    output_dir.mkdir(parents=True, exist_ok=True)
    if not is_distributed_rank():
        _reset_accelerate_state()
    status: RunStatus = "failed"
    try:
        # oom_fault: a testing aid, nothing unless its environment setting is present
        with oom_fault(), StopSignal(stop_file) as stop:
            status, summary = _train(spec, output_dir, gated, stop, resume, cache_dir, reach)
    except SpecError as exc:
        gated(make_event("done", status="failed", summary=failure_summary(exc)))
        raise
    except Exception as exc:
        logger.exception("training failed")
        summary = failure_summary(exc)
    gated(make_event("done", status=status, summary=summary))
    return status
