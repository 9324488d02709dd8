"""What both backends do the same way: model set-up, step counts, scheduler, metrics, final output."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from datasets import Dataset
from torch import nn
from transformers import get_scheduler, set_seed

from trainer_core.modeling import build_model
from trainer_core.spec import JobSpec

LENGTH_COLUMN = "length"


def column_lengths(dataset: Dataset) -> list[int] | None:
    """The ``length`` column data preparation adds (None when a dataset lacks it)."""
    if LENGTH_COLUMN not in dataset.column_names:
        return None
    return [int(n) for n in dataset[LENGTH_COLUMN]]


def build_training_model(spec: JobSpec, labels: list[str]) -> nn.Module:
    """The model, seeded first so a random init is reproducible, with gradient checkpointing if asked."""
    set_seed(spec.training.seed)
    model = build_model(spec.task, spec.model, labels)
    if spec.efficiency.gradient_checkpointing:
        # Non-reentrant checkpointing works with frozen inputs and autocast; the reentrant kind does not.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
    return model


@dataclass(frozen=True)
class StepPlan:
    """How many optimizer steps an epoch has and the run takes."""

    batches_per_epoch: int
    steps_per_epoch: int
    total_steps: int
    num_epochs: int


def plan_steps(spec: JobSpec, batches_per_epoch: int) -> StepPlan:
    """Optimizer steps as Trainer counts them: a partial accumulation at an epoch's end still steps."""
    accum = spec.efficiency.gradient_accumulation_steps
    steps_per_epoch = max(math.ceil(batches_per_epoch / accum), 1)
    if spec.training.max_steps > 0:
        total = spec.training.max_steps
    else:
        total = max(math.ceil(spec.training.num_train_epochs * steps_per_epoch), 1)
    return StepPlan(batches_per_epoch, steps_per_epoch, total, math.ceil(total / steps_per_epoch))


def warmup_steps(spec: JobSpec, total_steps: int) -> int:
    """``warmup_steps`` when given, else ``warmup_ratio`` of the run (TrainingArguments' rule)."""
    if spec.training.warmup_steps > 0:
        return spec.training.warmup_steps
    return math.ceil(spec.training.warmup_ratio * total_steps)


def build_scheduler(
    spec: JobSpec, optimizer: torch.optim.Optimizer, total_steps: int
) -> torch.optim.lr_scheduler.LRScheduler:
    scheduler: torch.optim.lr_scheduler.LRScheduler = get_scheduler(
        spec.training.lr_scheduler_type,
        optimizer=optimizer,
        num_warmup_steps=warmup_steps(spec, total_steps),
        num_training_steps=total_steps,
    )
    return scheduler


def eval_values(
    spec: JobSpec, predictions: np.ndarray, references: np.ndarray, num_labels: int, loss: float | None
) -> dict[str, float]:
    """``eval_loss`` and the spec's metrics, keys prefixed ``eval_`` as Trainer reports them."""
    from trainer_core.metrics import compute_metrics

    values = {f"eval_{k}": float(v) for k, v in compute_metrics(
        list(spec.metrics), predictions, references, num_labels
    ).items()}
    if loss is not None:
        values = {"eval_loss": float(loss), **values}
    return values


def write_run_files(output_dir: Path, spec: JobSpec, metrics: dict[str, Any]) -> None:
    """``spec.json`` and ``metrics.json`` next to the final model (main process only)."""
    (output_dir / "spec.json").write_text(spec.model_dump_json(indent=2), encoding="utf-8")
    (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2), encoding="utf-8")


def save_processor(processor: Any, output_dir: Path) -> None:
    if processor is not None and hasattr(processor, "save_pretrained"):
        processor.save_pretrained(str(output_dir))
