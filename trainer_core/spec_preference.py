"""The ``method`` of a causal-LM job and the ``preference`` section: DPO and ORPO.

Kept apart from :mod:`trainer_core.spec` like the adapter section: the spec imports it. The losses
and the reference model are :mod:`trainer_core.preference`; the rows are
:mod:`trainer_core.data.preference`.

* ``sft``: supervised fine-tuning (the default, and the only method before DPO/ORPO).
* ``dpo``: Direct Preference Optimization (Rafailov et al. 2023), against a reference model: the same
  base with the adapter disabled under LoRA/QLoRA, a frozen copy of the starting weights for a full
  fine-tune, or log-probabilities computed once before training (``reference: precomputed``).
* ``orpo``: Odds Ratio Preference Optimization (Hong et al. 2024): the SFT loss on the chosen answer
  plus ``beta`` times an odds-ratio term; no reference model.

Field names and defaults follow TRL's ``DPOConfig`` / ``ORPOConfig``, so a TRL user's numbers carry over.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from trainer_core.spec_base import StrictModel, combination_error

Method = Literal["sft", "dpo", "orpo"]
PREFERENCE_METHODS: frozenset[str] = frozenset({"dpo", "orpo"})
DPOLoss = Literal["sigmoid", "ipo", "hinge"]
Reference = Literal["base", "precomputed"]
# Fields only DPO reads; on ORPO they must keep their defaults (a dumped spec lists them).
DPO_FIELDS = ("loss_type", "label_smoothing", "reference")
# The reward metrics a preference run logs and evaluates, as TRL names them (evaluation adds `eval_`).
REWARD_METRICS: tuple[str, ...] = (
    "rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen", "logps/rejected",
)  # fmt: skip
# ORPO's own, as TRL's ORPOTrainer logs them: the answer NLL and the mean log-sigmoid of the log-odds ratio.
ORPO_METRICS: tuple[str, ...] = ("nll_loss", "log_odds_ratio")


def reward_metrics(method: str) -> tuple[str, ...]:
    """The metrics a ``method`` run logs with every loss and reports from every evaluation, in order."""
    return REWARD_METRICS + ORPO_METRICS if method == "orpo" else REWARD_METRICS


class PreferenceSpec(StrictModel):
    """How a ``dpo`` or ``orpo`` job weighs chosen against rejected answers."""

    beta: float = Field(
        default=0.1, gt=0, le=100,
        description="DPO: the KL penalty's temperature (higher stays closer to the reference). ORPO: the odds-ratio "
        "term's weight (TRL's `beta`, the paper's lambda).",
    )  # fmt: skip
    loss_type: DPOLoss = Field(
        default="sigmoid", description="DPO: `sigmoid` (the paper's), `ipo` (Azar et al.) or `hinge` (SLiC)."
    )
    label_smoothing: float = Field(
        default=0.0, ge=0.0, lt=0.5,
        description="DPO with `sigmoid`: the assumed share of flipped preference labels (conservative DPO).",
    )  # fmt: skip
    reference: Reference = Field(
        default="base",
        description="DPO: `base` scores the reference with the starting weights (the adapter disabled under "
        "LoRA/QLoRA, else a frozen copy); `precomputed` scores every row once before training and keeps no copy.",
    )  # fmt: skip

    @model_validator(mode="after")
    def _smoothing_is_sigmoid(self) -> PreferenceSpec:
        if self.label_smoothing and self.loss_type != "sigmoid":
            raise combination_error("preference.label_smoothing", "applies to loss_type 'sigmoid' only")
        return self

    def dpo_fields_changed(self) -> list[str]:
        """The DPO-only fields set away from their defaults (an ORPO job must leave them)."""
        fields = type(self).model_fields
        return [name for name in DPO_FIELDS if getattr(self, name) != fields[name].default]


def method_errors(method: str, preference: PreferenceSpec | None, task: str) -> list[tuple[str, str]]:
    """``(field, message)`` for each rule a ``method``/``preference`` pair breaks (JobSpec raises the first)."""
    if method == "sft":
        if preference is not None:
            return [("preference", "applies to method 'dpo' or 'orpo'; this job's method is 'sft'")]
        return []
    if task != "causal-lm":
        return [("method", f"{method!r} trains causal-lm models; this job's task is {task!r}")]
    if method == "orpo" and preference is not None and (changed := preference.dpo_fields_changed()):
        return [(f"preference.{changed[0]}", "applies to method 'dpo' only; ORPO has no reference model")]
    return []
