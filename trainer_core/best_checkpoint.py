"""The best checkpoint of a run, the same in both backends: by ``training.metric_for_best_model`` among
the checkpoints evaluated at their own step. With ``training.keep_best_checkpoint`` (or
``load_best_model_at_end``) retention never deletes it (the run's own ``checkpoint-N`` folders and the
object store's copies), and with ``load_best_model_at_end`` its weights become the final model.

The best so far goes into every checkpoint's description, so a resumed run and the slot's uploader
(which rotates the store) know it without reading the metrics.
"""

from __future__ import annotations

import math
from typing import Any

from trainer_core.spec import TrainingSpec

META_KEY = "best_checkpoint"


class BestCheckpoint:
    def __init__(self, training: TrainingSpec) -> None:
        self.key, self.higher = training.best_metric, training.best_higher_is_better
        self.active = training.keeps_best
        self.step: int | None = None
        self.value: float | None = None
        self.evaluation: dict[str, float] = {}  # its whole evaluation: the final one when it is loaded

    def saved(self, step: int, evaluation: dict[str, float] | None) -> None:
        """A checkpoint at ``step``, with the evaluation made at that same step (None: not evaluated,
        so not a candidate). Ties keep the earlier checkpoint."""
        value = (evaluation or {}).get(self.key)
        if value is None or not math.isfinite(value):
            return
        if self.value is None or (value > self.value if self.higher else value < self.value):
            self.step, self.value, self.evaluation = step, value, dict(evaluation or {})

    def protected(self) -> int | None:
        """The step retention must keep, when the spec asks to keep the best."""
        return self.step if self.active else None

    def state(self) -> dict[str, Any]:
        return {"step": self.step, "value": self.value, "metric": self.key, "evaluation": self.evaluation}

    def restore(self, state: dict[str, Any] | None) -> None:
        if state is not None and state.get("metric") == self.key:
            self.step, self.value = state.get("step"), state.get("value")
            self.evaluation = dict(state.get("evaluation") or {})


def protected_step(meta: dict[str, Any]) -> int | None:
    """The best checkpoint a checkpoint's description says retention must keep (the uploader's view)."""
    if not TrainingSpec.model_validate((meta.get("spec") or {}).get("training") or {}).keeps_best:
        return None
    step = (meta.get(META_KEY) or {}).get("step")
    return int(step) if step is not None else None
