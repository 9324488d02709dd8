"""Early stopping, the same in both backends: each evaluation's values go to :class:`EarlyStopper`,
which says when the spec's metric has not improved by more than ``min_delta`` for ``patience``
evaluations in a row. The backend then ends training as if it had reached its last step: the final
model is saved, the job succeeds, and its final metrics say ``stopped_early`` and at which step.

The count goes into every checkpoint, so a resumed run stops at the step an uninterrupted one would.
Every process sees the same values (evaluations are gathered across ranks before they are reported),
so every rank takes the same decision at the same step without a collective of its own.
"""

from __future__ import annotations

import math
from typing import Any

from trainer_core.spec import EarlyStoppingSpec


class EarlyStopper:
    def __init__(self, spec: EarlyStoppingSpec | None) -> None:
        self.spec = spec
        self.best: float | None = None
        self.stale = 0  # evaluations in a row without improvement
        self.stopped_at: int | None = None

    def observe(self, step: int, values: dict[str, float]) -> bool:
        """Record one evaluation; True once the run should stop (and from then on)."""
        if self.spec is None or self.stopped_at is not None:
            return self.stopped_at is not None
        value = values.get(self.spec.key)
        if value is None or not math.isfinite(value):
            self.stale += 1  # a missing or non-finite value is no improvement
        elif self.best is None or self._improves(value):
            self.best, self.stale = value, 0
        else:
            self.stale += 1
        if self.stale >= self.spec.patience:
            self.stopped_at = step
        return self.stopped_at is not None

    def _improves(self, value: float) -> bool:
        assert self.spec is not None and self.best is not None
        gain = value - self.best if self.spec.higher_is_better else self.best - value
        return gain > self.spec.min_delta

    def state(self) -> dict[str, Any] | None:
        """What a checkpoint keeps of the count (None without early stopping)."""
        return None if self.spec is None else {"best": self.best, "stale": self.stale}

    def restore(self, state: dict[str, Any] | None) -> None:
        """Continue the count a checkpoint kept (a checkpoint from before the count was kept: afresh)."""
        if self.spec is not None and state is not None:
            self.best, self.stale = state.get("best"), int(state.get("stale", 0))

    def summary(self) -> dict[str, bool | int]:
        """What the run's ``train`` summary (and so the job's final metrics) says about it."""
        if self.spec is None:
            return {}
        if self.stopped_at is None:
            return {"stopped_early": False}
        return {"stopped_early": True, "stopped_at_step": self.stopped_at}
