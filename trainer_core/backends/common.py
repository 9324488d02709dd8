"""What both backends do the same way: model set-up, step counts, scheduler, metrics, events, final output.

The bookkeeping around the training step lives here once: the world size, batches per epoch, the
memory/progress/metric/eval events (:class:`RunEvents`) and the train summary (:func:`train_summary`),
so a run reports the same things, under the same keys, whichever backend trained it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from datasets import Dataset
from torch import nn
from transformers import get_scheduler, set_seed

from trainer_core.best_checkpoint import META_KEY as BEST_META_KEY
from trainer_core.best_checkpoint import BestCheckpoint
from trainer_core.checkpoint import read_meta
from trainer_core.data.packing import PackedCollator
from trainer_core.early_stopping import EarlyStopper
from trainer_core.events import EventSink, make_event
from trainer_core.init_from import init_source, load_adapter, load_init_weights, load_optimizer_state
from trainer_core.liger import apply_liger
from trainer_core.memory_report import memory_event
from trainer_core.modeling import build_model
from trainer_core.spec import JobSpec

LENGTH_COLUMN = "length"


def column_lengths(dataset: Dataset) -> list[int] | None:
    """The ``length`` column data preparation adds (None when a dataset lacks it)."""
    if LENGTH_COLUMN not in dataset.column_names:
        return None
    return [int(n) for n in dataset[LENGTH_COLUMN]]


def without_length(dataset: Dataset) -> Dataset:
    """``dataset`` without its ``length`` column (the samplers take the lengths, the model does not)."""
    return dataset.remove_columns(LENGTH_COLUMN) if LENGTH_COLUMN in dataset.column_names else dataset


def build_training_model(spec: JobSpec, labels: list[str], *, fresh: bool = True) -> nn.Module:
    """The model, seeded first so a random init is reproducible, with gradient checkpointing if asked.

    With ``spec.adapter`` it is the PEFT model over a frozen (for qlora, 4-bit) base. With ``init_from``
    it starts from that checkpoint (trainer_core/init_from.py); ``fresh``: not resuming its own checkpoint.
    """
    set_seed(spec.training.seed)
    checkpointing = spec.efficiency.gradient_checkpointing
    source = init_source(spec)
    weights = source.full_weights if source is not None else None
    if spec.adapter is not None:
        from trainer_core.adapters import build_base_model, with_adapter
        from trainer_core.lm_preflight import check_adapter_targets

        check_adapter_targets(spec)  # a field error, where PEFT would fail with a ValueError
        base = build_base_model(spec, labels, weights)
        apply_liger(spec, base)  # before PEFT wraps its Linears
        model = with_adapter(spec, base, checkpointing)
        if source is not None and source.adapter is not None and fresh:
            load_adapter(model, source)
    else:
        model = build_model(spec.task, spec.model, labels, weights)
        if source is not None and source.sharded:
            load_init_weights(model, source)
        apply_liger(spec, model)
        if checkpointing:
            # Non-reentrant checkpointing works with frozen inputs and autocast; the reentrant kind does not.
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
    if spec.task == "causal-lm":
        # Training needs no KV cache, and with one transformers does not look for packed sequences, so
        # a flattened packed batch's examples would attend to each other (trainer_core/data/packing.py). Trainer
        # sets this from its arguments; the Accelerate loop has no one else to do it.
        model.config.use_cache = False  # type: ignore[union-attr]
    return model


def start_optimizer(spec: JobSpec, optimizer: torch.optim.Optimizer, fresh: bool) -> None:
    """``init_from.resume_optimizer``: the checkpoint's optimizer state, on a fresh start only (a resume
    loads its own)."""
    if fresh and spec.init_from is not None and spec.init_from.resume_optimizer:
        source = init_source(spec)
        assert source is not None
        load_optimizer_state(optimizer, source)


def backend_trackers(spec: JobSpec) -> list[str]:
    """The ``report_to`` trackers a backend feeds itself: TensorBoard. W&B and MLflow take the run's
    events instead (trainer_core/trackers.py), so both backends log the very points the job streams."""
    return [t for t in spec.training.report_to if t == "tensorboard"]


def world_size() -> int:
    """Processes training this run: torchrun's ``WORLD_SIZE``, 1 outside torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def batches_per_epoch(num_samples: int, per_device_batch_size: int, processes: int) -> int:
    """Micro-batches each process sees per epoch; the last may be partial, none is dropped.

    Equal to ``len()`` of accelerate's sharded loader and to what Trainer iterates.
    """
    return -(-num_samples // (per_device_batch_size * processes))


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
    spec: JobSpec,
    predictions: np.ndarray | None,
    references: np.ndarray | None,
    num_labels: int,
    loss: float | None,
    rewards: dict[str, float] | None = None,
) -> dict[str, float]:
    """``eval_loss`` and the spec's metrics, keys prefixed ``eval_`` as Trainer's: a causal LM's perplexity,
    or a DPO/ORPO run's ``rewards`` (its reward metrics, ``JobSpec.reward_metrics``)."""
    from trainer_core.metrics import compute_metrics, language_model_metrics

    if spec.is_preference:
        assert loss is not None and rewards is not None  # the preference objective computes both
        scores = rewards
    elif spec.task == "causal-lm":
        assert loss is not None  # a language model always computes its loss
        scores = language_model_metrics(loss)
    else:
        assert predictions is not None and references is not None
        scores = compute_metrics(list(spec.metrics), predictions, references, num_labels)
    values = {f"eval_{k}": float(v) for k, v in scores.items()}
    if loss is not None:
        values = {"eval_loss": float(loss), **values}
    return values


class RunEvents:
    """The events a run emits, the same in both backends; remembers the last evaluation."""

    def __init__(self, emit: EventSink, spec: JobSpec, resume_from: Path | None = None) -> None:
        self.emit = emit
        self.early = EarlyStopper(spec.early_stopping)
        self.best = BestCheckpoint(spec.training)
        if resume_from is not None:  # what the checkpoint's run had learned from its evaluations
            meta = read_meta(resume_from)
            self.early.restore(meta.get("early_stopping"))
            self.best.restore(meta.get(BEST_META_KEY))
        self.memory_sent = False
        self.last_eval: dict[str, float] = {}
        self.eval_step = -1
        self.last_loss: float | None = None

    def step_done(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, total_steps: int, epoch: float | None
    ) -> None:
        """After an optimizer step: ``memory`` once (optimizers allocate state on the first), ``progress``."""
        if not self.memory_sent:
            self.emit(memory_event(model, optimizer))
            self.memory_sent = True
        self.emit(make_event("progress", step=step, total_steps=total_steps, epoch=epoch))

    def metric(self, step: int, epoch: float | None, values: dict[str, Any]) -> None:
        """A ``metric`` event: loss, learning rate and gradient norm at a logging step."""
        self.last_loss = values.get("loss")
        self.emit(make_event("metric", step=step, epoch=epoch, values=values))

    def evaluated(self, step: int, epoch: float | None, values: dict[str, float]) -> None:
        """An ``eval`` event; its values become the run's final evaluation unless another follows."""
        self.last_eval, self.eval_step = values, step
        self.emit(make_event("eval", step=step, epoch=epoch, values=values))
        self.early.observe(step, values)

    def checkpoint_written(self, step: int) -> dict[str, Any]:
        """A checkpoint at ``step`` is about to be described: it may be the best (when evaluated at its
        step: both backends evaluate before they save); returns what its description keeps of the
        evaluations (see write_meta)."""
        self.best.saved(step, self.last_eval if self.eval_step == step else None)
        kept: dict[str, Any] = {BEST_META_KEY: self.best.state()}
        early = self.early.state()
        if early is not None:
            kept["early_stopping"] = early
        return kept

    def final_eval(self, load_best: bool) -> dict[str, float]:
        """The evaluation the final model has: the best checkpoint's when its weights were loaded."""
        return self.best.evaluation if load_best and self.best.evaluation else self.last_eval

    @property
    def stop_early(self) -> bool:
        """The spec's early stopping says training should end now (after the evaluation just reported)."""
        return self.early.stopped_at is not None

    def checkpoint_saved(self, step: int, epoch: float | None) -> None:
        """A ``checkpoint`` event, once its folder is complete (its meta file written): the step, the
        epoch and the last training loss logged at or before it."""
        self.emit(make_event("checkpoint", step=step, epoch=epoch, loss=self.last_loss))


def train_summary(runtime_s: float, samples: int, mean_loss: float | None) -> dict[str, Any]:
    """The ``train`` part of a run's summary (and of the job's final metrics), same keys in both backends.

    ``samples`` counts every process; ``mean_loss`` is the mean training loss of this session's steps.
    """
    return {
        "train_runtime_s": runtime_s,
        "train_samples": samples,
        "train_samples_per_second": samples / runtime_s if runtime_s > 0 else 0.0,
        "train_loss": mean_loss,
    }


def write_run_files(output_dir: Path, spec: JobSpec, metrics: dict[str, Any]) -> None:
    """``spec.json`` and ``metrics.json`` next to the final model (main process only)."""
    (output_dir / "spec.json").write_text(spec.model_dump_json(indent=2), encoding="utf-8")
    (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2), encoding="utf-8")


def save_processor(processor: Any, output_dir: Path) -> None:
    """The tokenizer (with its chat template) or processor next to the model (main process only)."""
    if processor is not None and hasattr(processor, "save_pretrained"):
        processor.save_pretrained(str(output_dir))


MERGED_DIR = "merged"


def save_final_extras(spec: JobSpec, model: nn.Module, processor: Any, output_dir: Path) -> None:
    """What follows the final model (main process only): the processor and, for ``adapter.merge``,
    the base with the adapter folded in, a plain transformers model in ``merged/``.

    Merging rewrites the base weights in place, so this comes after every other use of ``model``.
    """
    save_processor(processor, output_dir)
    if spec.adapter is None or not spec.adapter.merge:
        return
    merged = model.merge_and_unload()  # type: ignore[operator]
    merged.save_pretrained(str(output_dir / MERGED_DIR))
    save_processor(processor, output_dir / MERGED_DIR)


def collator_for(collator: Any, model: nn.Module, emit: EventSink) -> Any:
    """The data's collator for ``model``: packed causal-LM rows are collated for its attention
    implementation (rows with a block-diagonal mask, or one flattened sequence under flash attention:
    trainer_core/data/packing.py), and a ``log`` event with a ``packing`` field says which ran."""
    if not isinstance(collator, PackedCollator):
        return collator
    bound = collator.for_model(model.config)  # type: ignore[arg-type]
    message = f"packing: {bound.layout} ({bound.attn_implementation} attention)"
    emit(make_event("log", message=message, packing=bound.layout))
    return bound
