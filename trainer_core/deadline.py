"""``resources.max_runtime_minutes``: a run that trains past its time limit stops with reason ``timeout``.

Like :mod:`trainer_core.nan_guard`, the limit wraps the run's event sink, so both backends are held to
it at every optimizer step (each reports a ``progress`` event) without a line of their own. The clock
is this run's: a job resumed after a requeue gets its limit again.
"""

from __future__ import annotations

import time

from trainer_core.events import Event, EventSink


class RunTimeoutError(RuntimeError):
    """The run trained for longer than ``resources.max_runtime_minutes``."""

    def __init__(self, minutes: float, step: int):
        self.minutes, self.step = minutes, step
        super().__init__(f"the run exceeded resources.max_runtime_minutes={minutes:g} (stopped at step {step})")


def deadline_guard(sink: EventSink, minutes: float | None) -> EventSink:
    """``sink``, raising :class:`RunTimeoutError` at the first step past ``minutes`` from now (None: no limit)."""
    if minutes is None:
        return sink
    deadline = time.monotonic() + minutes * 60.0

    def emit(event: Event) -> None:
        sink(event)
        if event.get("event") == "progress" and time.monotonic() > deadline:
            raise RunTimeoutError(minutes, int(event.get("step") or 0))

    return emit
