"""What a backend receives (:class:`RunContext`) and returns (:class:`BackendResult`).

A module of its own so the backends import it without importing the package that picks them.
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
