"""What one micro-batch costs, the same call in both backends: SFT's loss, or DPO's / ORPO's with reward metrics.

Both backends call :class:`Objective` for every training and evaluation batch, so a preference run
goes through the same loop, events, memory accounting and checkpoints as any other run; only the
loss differs. A preference batch holds each pair twice (chosen rows, then rejected rows,
trainer_core/data/preference.py); the losses are :mod:`trainer_core.preference`'s (TRL's formulas),
the reference log-probabilities come from the batch (``reference: precomputed``) or from
:mod:`trainer_core.backends.reference`.

Dropout is switched off in a preference run's model, as TRL's ``DPOConfig``/``ORPOConfig`` do by
default (``disable_dropout=True``): the policy and the reference then score a pair the same way.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from trainer_core.backends.reference import (
    REF_COLUMNS,
    ReferenceScorer,
    reference_scorer,
    uses_precomputed_reference,
    with_reference_logps,
)
from trainer_core.chunked_loss import CHUNKED_REFUSAL, causal_lm_loss, chunkable
from trainer_core.spec import FieldError, JobSpec, SpecError

if TYPE_CHECKING:
    from accelerate import Accelerator

    from trainer_core.backends.context import RunContext
    from trainer_core.data import PreparedData


def batch_samples(spec: JobSpec, batch: dict[str, Any]) -> int:
    """The examples in a micro-batch: rows, or pairs for a preference batch (two rows each)."""
    rows = int(batch["labels"].shape[0])
    return rows // 2 if spec.is_preference else rows


def disable_dropout(model: nn.Module) -> None:
    """Every ``nn.Dropout`` to p=0 (TRL's ``disable_dropout_in_model``)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


def chunked_loss_for(spec: JobSpec, model: nn.Module) -> bool:
    """Whether the run computes its SFT loss in chunks: ``efficiency.chunked_loss`` on a model whose
    logits are its head's output (preflight refuses the others at submit; this is the run's own check)."""
    if not spec.efficiency.chunked_loss:
        return False
    if not chunkable(model):
        raise SpecError([FieldError("efficiency.chunked_loss", CHUNKED_REFUSAL)])
    return True


@dataclass
class Objective:
    """The loss of one micro-batch and, for a preference run, its reward metrics (batch means, detached)."""

    spec: JobSpec
    reference: ReferenceScorer | None = None
    # efficiency.chunked_loss: an SFT loss from the hidden states in chunks (trainer_core/chunked_loss.py)
    chunked: bool = False

    def __call__(self, model: nn.Module, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        if not self.spec.is_preference:
            return (causal_lm_loss(model, batch) if self.chunked else model(**batch).loss), {}
        from trainer_core.preference import policy_logps, preference_loss

        inputs = {key: value for key, value in batch.items() if key not in REF_COLUMNS}
        # The reference first: its no-grad forward then peaks alone (what trainer_core/memory/reference.py counts).
        ref_chosen, ref_rejected = self._reference_logps(batch, inputs)
        policy = policy_logps(model, inputs)
        out = preference_loss(self.spec.method, self.spec.preference_settings, policy, ref_chosen, ref_rejected)
        return out.loss, out.metrics

    def _reference_logps(
        self, batch: dict[str, Any], inputs: dict[str, Any]
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.spec.method == "orpo":
            return None, None
        if self.reference is not None:
            return self.reference(inputs)
        if REF_COLUMNS[0] not in batch:
            raise RuntimeError("a precomputed-reference DPO batch lacks its ref_chosen_logps/ref_rejected_logps")
        return batch[REF_COLUMNS[0]], batch[REF_COLUMNS[1]]


def start_objective(ctx: RunContext, model: nn.Module, accelerator: Accelerator) -> tuple[Objective, PreparedData]:
    """The run's objective, built once before training, and its data: with the reference log-prob
    columns for ``reference: precomputed`` (scored now, or read back on a resume).

    Call it after the model holds its starting weights (``init_from`` loaded) and before the backend
    prepares it (a frozen copy must not share accelerate's patched ``forward``).
    """
    spec, data = ctx.spec, ctx.data
    if not spec.is_preference:
        return Objective(spec, chunked=chunked_loss_for(spec, model)), data
    disable_dropout(model)
    if spec.method == "orpo":
        return Objective(spec), data
    autocast = accelerator.autocast
    if uses_precomputed_reference(spec):
        scorer = reference_scorer(spec, model, autocast, accelerator.device, frozen_copy=False)
        data = with_reference_logps(ctx, scorer, accelerator)
        scorer.release()  # no reference is kept for training
        return Objective(spec), data
    return Objective(spec, reference_scorer(spec, model, autocast, accelerator.device, frozen_copy=True)), data


@dataclass
class MetricWindow:
    """Reward metrics summed on the device between two reads (a logging window or an evaluation)."""

    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    count: int = 0

    def add(self, metrics: dict[str, torch.Tensor]) -> None:
        """One micro-batch's metrics (its batch means), without a host sync."""
        for key, tensor in metrics.items():
            value = tensor.detach().float()
            self.sums[key] = self.sums[key] + value if key in self.sums else value
        self.count += bool(metrics)

    def means(self, accelerator: Accelerator) -> dict[str, float]:
        """The window's mean of each metric over micro-batches and processes; empties the window.

        A collective: every process calls it at the same point (logging steps come to all of them).
        """
        if not self.count:
            return {}
        keys = list(self.sums)  # the same on every process: the loss of the run's method names them
        stacked = torch.stack([self.sums[key] for key in keys]) / self.count
        reduced = accelerator.reduce(stacked, reduction="mean")
        self.sums, self.count = {}, 0
        return dict(zip(keys, reduced.tolist(), strict=True))


def per_example(metrics: dict[str, torch.Tensor], examples: int, names: tuple[str, ...]) -> torch.Tensor:
    """A batch's metric means as ``[examples, len(names)]`` rows (``names``: the run's reward metrics):
    gathered across processes and averaged, each batch then counts by its size (as Trainer weights an
    evaluation's losses)."""
    row = torch.stack([metrics[key].detach().float() for key in names])
    return row.unsqueeze(0).repeat(examples, 1)


def reward_means(rows: Any, names: tuple[str, ...]) -> dict[str, float]:
    """An evaluation's reward metrics, ``names``, from the gathered :func:`per_example` rows."""
    values = torch.as_tensor(rows, dtype=torch.float32).reshape(-1, len(names)).mean(dim=0)
    return dict(zip(names, values.tolist(), strict=True))
