"""The two training backends, 🤗 ``Trainer`` and a hand-written ``Accelerator`` loop, behind one call.

Both receive a :class:`RunContext` (spec, prepared data, event sink, stop signal, checkpoint to
resume from) and return a :class:`BackendResult`; :mod:`trainer_core.run` does the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer_core.events import EventSink, RunStatus
from trainer_core.spec import JobSpec
from trainer_core.stopping import StopSignal

if TYPE_CHECKING:
    from trainer_core.data import PreparedData


@dataclass
class RunContext:
    """Everything a backend needs; ``emit`` is already silent on processes other than the main one."""

    spec: JobSpec
    output_dir: Path
    data: PreparedData
    emit: EventSink
    stop: StopSignal
    resume_from: Path | None = None


@dataclass
class BackendResult:
    status: RunStatus
    global_step: int
    eval_metrics: dict[str, float] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)


def run_backend(ctx: RunContext) -> BackendResult:
    """Train with the backend the spec names."""
    if ctx.spec.training.backend == "trainer":
        from trainer_core.backends.trainer_backend import train_with_trainer

        return train_with_trainer(ctx)
    from trainer_core.backends.accelerate_backend import train_with_accelerate

    return train_with_accelerate(ctx)
