"""Stop a run whose loss stopped being finite, instead of letting it burn the rest of its steps.

The guard wraps the run's event sink: both backends report the loss of every logging step in a
``metric`` event (a non-finite value arrives as ``null``, see :func:`trainer_core.events.make_event`),
so one place sees every step of either backend. After ``training.nan_patience`` consecutive logging
steps without a finite loss it raises :class:`NanLossError`, which ends the run with reason ``nan_loss``.
"""

from __future__ import annotations

import math

from trainer_core.events import Event, EventSink


class NanLossError(RuntimeError):
    """The loss was not finite for ``patience`` consecutive logging steps, the last at ``step``."""

    def __init__(self, patience: int, step: int):
        self.patience, self.step = patience, step
        super().__init__(f"loss not finite for {patience} consecutive logging steps (last at step {step})")


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and math.isfinite(value)


def nan_guard(sink: EventSink, patience: int) -> EventSink:
    """``sink``, raising :class:`NanLossError` once ``patience`` logged losses in a row are not finite
    (0 turns the guard off). The metric event that trips it is delivered first, so it is on record."""
    if patience <= 0:
        return sink
    bad = 0

    def emit(event: Event) -> None:
        nonlocal bad
        sink(event)
        values = event.get("values") or {}
        if event.get("event") != "metric" or "loss" not in values:
            return
        bad = 0 if _finite(values["loss"]) else bad + 1
        if bad >= patience:
            raise NanLossError(patience, int(event.get("step") or 0))

    return emit
