"""The DPO and ORPO losses on a batch of preference pairs, written once for every backend.

A batch is what :class:`~trainer_core.data.preference.PreferenceCollator` gives: ``input_ids``,
``attention_mask`` and ``labels`` of 2B rows (the chosen sequences, then the rejected ones; labels -100
on prompt and padding), and ``ref_chosen_logps`` / ``ref_rejected_logps`` when the reference is
precomputed. A backend calls :func:`policy_logps` (one forward) and :func:`preference_loss`; it owns the
reference model (its log-probs come from :func:`policy_logps` on the reference, under ``no_grad``).

The formulas are TRL 1.16's, checked against its trainers on the same batch
(tests/trainer_core/test_preference_exactness.py):

* DPO (``trl.DPOTrainer._compute_loss``): ``delta = (pi_c - ref_c) - (pi_r - ref_r)`` over summed answer
  log-probs; ``sigmoid`` ``-log sigmoid(beta delta)``, ``hinge`` ``relu(1 - beta delta)``, ``ipo``
  ``(delta' - 1 / (2 beta))^2`` with each log-ratio divided by its answer's token count (TRL's
  length-normalised IPO). ``label_smoothing`` (sigmoid only) is conservative DPO's
  ``(1 - e) * loss(delta) + e * loss(-delta)``: TRL 1.16's ``sigmoid`` ignores it (older TRL applied this
  form), so the test checks it as that mix of TRL's values. Rewards are ``beta`` times the log-ratios.
* ORPO (``trl.experimental.orpo.ORPOTrainer``): length-averaged answer log-probs, ``log_odds = (c - r) -
  (log(1 - e^c) - log(1 - e^r))``, loss ``nll - beta * mean(log sigmoid(log_odds))``, rewards ``beta``
  times the averaged log-probs. One difference: TRL's NLL also counts the prompt tokens (as the ORPO
  authors' code does by default); here it counts the chosen answer's tokens only, since a prompt never
  counts in a preference loss. ``nll + beta * (TRL's odds-ratio term)`` is TRL's loss exactly once the
  NLL's mask matches (the test shows both).

The losses are computed here, not by TRL: TRL 1.16 computes them inside its trainers' ``compute_loss``
(no function to call), and running its trainers would make a second pipeline. TRL's
``selective_log_softmax`` gathers the log-probs (no full log-softmax copy of the logits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from trl.trainer.utils import selective_log_softmax

from trainer_core.data.causal_lm import IGNORE_INDEX
from trainer_core.spec_preference import PreferenceSpec


def sequence_logps(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the summed log-probability of the counted next tokens (``labels != -100``; position t's
    logits predict label t + 1) and how many there are. ``labels`` are unshifted, as the collator gives."""
    targets = labels[:, 1:]
    counted = targets != IGNORE_INDEX
    per_token = selective_log_softmax(logits[:, :-1, :], targets.masked_fill(~counted, 0), row_mask=counted)
    return (per_token * counted).sum(-1), counted.sum(-1)


@dataclass
class PolicyLogps:
    """A forward's answer log-probs: ``chosen``/``rejected`` summed per row ([B]), the token counts
    behind them, and ``chosen_nll``, the mean NLL over every chosen answer token of the batch (ORPO)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    chosen_nll: torch.Tensor


def policy_logps(model: Any, batch: dict[str, torch.Tensor]) -> PolicyLogps:
    """One forward over the batch's 2B rows; the model gets no labels, so it computes no loss of its own."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logps, counts = sequence_logps(logits, batch["labels"])
    half = logps.shape[0] // 2
    chosen, chosen_tokens = logps[:half], counts[:half]
    return PolicyLogps(
        chosen=chosen,
        rejected=logps[half:],
        chosen_tokens=chosen_tokens,
        rejected_tokens=counts[half:],
        chosen_nll=-chosen.sum() / chosen_tokens.sum().clamp(min=1),
    )


@dataclass
class PreferenceOutput:
    """The batch's loss (with grad) and its detached metrics: the batch means named by
    :func:`~trainer_core.spec_preference.reward_metrics` for the method."""

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


def preference_loss(
    method: str,
    settings: PreferenceSpec,
    policy: PolicyLogps,
    ref_chosen: torch.Tensor | None,
    ref_rejected: torch.Tensor | None,
) -> PreferenceOutput:
    """The ``dpo`` loss against the reference log-probs, or the ``orpo`` loss (no reference: pass None)."""
    if method == "orpo":
        return _orpo_loss(settings.beta, policy)
    if method != "dpo":
        raise ValueError(f"no preference loss for method {method!r}")
    if ref_chosen is None or ref_rejected is None:
        raise ValueError("DPO needs the reference model's log-probs of both answers")
    return _dpo_loss(settings, policy, ref_chosen, ref_rejected)


def _dpo_loss(
    settings: PreferenceSpec, policy: PolicyLogps, ref_chosen: torch.Tensor, ref_rejected: torch.Tensor
) -> PreferenceOutput:
    beta = settings.beta
    chosen_ratio = policy.chosen - ref_chosen.to(policy.chosen)
    rejected_ratio = policy.rejected - ref_rejected.to(policy.rejected)
    delta = chosen_ratio - rejected_ratio
    if settings.loss_type == "sigmoid":
        smoothing = settings.label_smoothing
        losses = -F.logsigmoid(beta * delta) * (1 - smoothing) - F.logsigmoid(-beta * delta) * smoothing
    elif settings.loss_type == "hinge":
        losses = torch.relu(1 - beta * delta)
    else:  # ipo, per answer token (TRL's normalisation, confirmed with the IPO authors)
        chosen_mean = chosen_ratio / policy.chosen_tokens.clamp(min=1)
        rejected_mean = rejected_ratio / policy.rejected_tokens.clamp(min=1)
        losses = (chosen_mean - rejected_mean - 1 / (2 * beta)) ** 2
    metrics = _reward_metrics(beta * chosen_ratio, beta * rejected_ratio, policy.chosen, policy.rejected)
    return PreferenceOutput(loss=losses.mean(), metrics=metrics)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - e^x) for x < 0, stably: trl.experimental.orpo's own (importing trl.experimental warns)."""
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _orpo_loss(beta: float, policy: PolicyLogps) -> PreferenceOutput:
    chosen = policy.chosen.float() / policy.chosen_tokens.clamp(min=1)
    rejected = policy.rejected.float() / policy.rejected_tokens.clamp(min=1)
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
    ratio = F.logsigmoid(log_odds)
    metrics = _reward_metrics(beta * chosen, beta * rejected, chosen, rejected)
    metrics["nll_loss"] = policy.chosen_nll.detach()
    metrics["log_odds_ratio"] = ratio.detach().mean()
    return PreferenceOutput(loss=policy.chosen_nll - beta * ratio.mean(), metrics=metrics)


def _reward_metrics(
    chosen_rewards: torch.Tensor,
    rejected_rewards: torch.Tensor,
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
) -> dict[str, torch.Tensor]:
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    return {
        "rewards/chosen": chosen_rewards.mean(),
        "rewards/rejected": rejected_rewards.mean(),
        "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
        "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
        "logps/chosen": chosen_logps.detach().mean(),
        "logps/rejected": rejected_logps.detach().mean(),
    }
