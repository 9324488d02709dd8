"""The 🤗 ``Trainer`` backend: TrainingArguments from the spec, trainjobs' own optimizer and scheduler.

A callback turns Trainer's hooks into trainjobs events, marks checkpoints as self-describing, and
polls the stop signal after every optimizer step. A DPO/ORPO run's loss and reward metrics come from
the shared objective (trainer_core/backends/objective.py) through ``compute_loss`` and
``prediction_step``; everything else is the SFT run's.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import (
    EvalPrediction,
    PrinterCallback,
    Trainer,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import EvalLoopOutput

from trainer_core.backends.common import (
    LENGTH_COLUMN,
    RunEvents,
    backend_trackers,
    batches_per_epoch,
    build_scheduler,
    build_training_model,
    collator_for,
    column_lengths,
    eval_values,
    plan_steps,
    save_final_extras,
    save_processor,
    start_optimizer,
    train_summary,
    without_length,
    world_size,
)
from trainer_core.backends.context import BackendResult, RunContext
from trainer_core.backends.objective import (
    MetricWindow,
    Objective,
    batch_samples,
    per_example,
    reward_means,
    start_objective,
)
from trainer_core.backends.reference import keep_reference_logps
from trainer_core.backends.sampling import EpochSampler, eval_order
from trainer_core.checkpoint import TrainProgress, checkpoint_dir, read_progress, rotate_checkpoints, write_meta
from trainer_core.metrics import compute_metrics
from trainer_core.optimizers import build_optimizer

logger = logging.getLogger(__name__)

# Trainer's own bookkeeping keys in evaluate() results; not metrics of the model.
_EVAL_BOOKKEEPING = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "epoch")


class _SeededOrderTrainer(Trainer):
    """Trainer whose training order depends only on (seed, epoch): trainjobs' :class:`EpochSampler`.

    Trainer's own samplers draw from the global RNG when iterated, so a run resumed mid-epoch would
    see another order than the run it continues; Trainer calls ``set_epoch`` on this one each epoch.
    The sampler also groups by the lengths data preparation already computed (Trainer would drop
    the ``length`` column first and re-measure every example).
    """

    def __init__(
        self,
        *args: Any,
        train_lengths: list[int] | None = None,
        eval_lengths: list[int] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self._train_lengths = train_lengths
        self._eval_lengths = eval_lengths
        self.samples_seen = 0  # this process's training samples (pairs for DPO/ORPO), for the train summary
        # A preference run's loss, or a chunked SFT loss (start_objective); else the model's own
        self.objective: Objective | None = None
        self._rewards = MetricWindow()  # reward metrics since the last logged loss

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        self.samples_seen += batch_samples(self.objective.spec, inputs) if self.objective else len(inputs["labels"])
        return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(
        self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False, num_items_in_batch: Any = None
    ) -> Any:
        if self.objective is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        loss, metrics = self.objective(model, inputs)
        self._rewards.add(metrics)
        return (loss, None) if return_outputs else loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # a training log: the reward metrics of the same window beside the loss
            logs.update(self._rewards.means(self.accelerator))
        super().log(logs, start_time)

    def prediction_step(
        self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool, ignore_keys: Any = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        if self.objective is None:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)
        inputs = self._prepare_inputs(inputs)
        with torch.no_grad():
            loss, metrics = self.objective(model, inputs)
        if not metrics:  # a chunked SFT loss: a causal LM is evaluated by its loss alone
            return loss.detach(), None, None
        # The metrics ride as "predictions", so Trainer gathers them across processes like the loss.
        spec = self.objective.spec
        return loss.detach(), per_example(metrics, batch_samples(spec, inputs), spec.reward_metrics), None

    def evaluation_loop(self, *args: Any, **kwargs: Any) -> EvalLoopOutput:
        output = super().evaluation_loop(*args, **kwargs)
        if self.objective is not None and output.predictions is not None and output.metrics is not None:
            prefix = kwargs.get("metric_key_prefix", "eval")
            means = reward_means(output.predictions, self.objective.spec.reward_metrics)
            output.metrics.update({f"{prefix}_{k}": v for k, v in means.items()})
        return output

    def _get_train_sampler(self, train_dataset: Any = None) -> torch.utils.data.Sampler | None:
        dataset: Any = train_dataset if train_dataset is not None else self.train_dataset
        group = self.args.train_batch_size * self.args.gradient_accumulation_steps
        return EpochSampler(len(dataset), self.args.seed, group, self._train_lengths)

    def _get_eval_sampler(self, eval_dataset: Any) -> Any:
        # Trainer's length-grouped eval sampler needs `input_ids` (not images or audio) and draws from
        # the global RNG; a fixed longest-first order needs neither.
        return eval_order(self._eval_lengths, len(eval_dataset))


class _RunCallback(TrainerCallback):
    """Events, self-describing checkpoints and graceful stop for a Trainer run."""

    def __init__(self, ctx: RunContext) -> None:
        self.ctx = ctx
        self.events = RunEvents(ctx.emit, ctx.spec, ctx.resume_from)
        self.cancelled = False

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self.events.step_done(kwargs["model"], kwargs["optimizer"], state.global_step, state.max_steps, state.epoch)
        if self.ctx.stop.requested_by_any(args.device) and state.global_step < state.max_steps:
            control.should_save = True  # Trainer saves right after this hook, then stops
            control.should_training_stop = True
            self.cancelled = True

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        if logs and "loss" in logs:
            values = {k: logs.get(k) for k in ("loss", "learning_rate", "grad_norm")}
            values.update({k: logs[k] for k in self.ctx.spec.reward_metrics if k in logs})
            self.events.metric(state.global_step, state.epoch, values)

    def on_evaluate(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        metrics: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        values = {k: float(v) for k, v in (metrics or {}).items() if k not in _EVAL_BOOKKEEPING}
        if self.ctx.spec.task == "causal-lm" and "eval_loss" in values:
            rewards = {k: values[f"eval_{k}"] for k in self.ctx.spec.reward_metrics if f"eval_{k}" in values}
            values = eval_values(self.ctx.spec, None, None, 0, values["eval_loss"], rewards or None)
            if metrics is not None:  # what trainer.evaluate() returns, and trackers log, has it too
                metrics.update(values)
        self.events.evaluated(state.global_step, state.epoch, values)
        if self.events.stop_early:  # Trainer ends the loop after this step, as at its last one
            control.should_training_stop = True

    def on_save(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        ckpt = checkpoint_dir(self.ctx.output_dir, state.global_step)
        if state.is_world_process_zero and ckpt.is_dir():
            # Trainer itself resumes by epoch and step from trainer_state.json; the rest is description.
            progress = TrainProgress(state.global_step, int(state.epoch or 0), 0)
            save_processor(self.ctx.data.processor, ckpt)  # a checkpoint loads on its own, tokenizer included
            keep_reference_logps(self.ctx.spec, self.ctx.output_dir, ckpt)
            write_meta(ckpt, self.ctx.spec, progress, "trainer", self.events.checkpoint_written(state.global_step))
            self.events.checkpoint_saved(state.global_step, state.epoch)
            keep = self.ctx.spec.training.save_total_limit
            rotate_checkpoints(self.ctx.output_dir, keep, self.events.best.protected())


def training_arguments(ctx: RunContext) -> TrainingArguments:
    """TrainingArguments named after the spec's fields (the spec follows their names)."""
    spec, t, eff = ctx.spec, ctx.spec.training, ctx.spec.efficiency
    on_cpu = not torch.cuda.is_available()
    several = world_size() > 1
    return TrainingArguments(
        output_dir=str(ctx.output_dir),
        per_device_train_batch_size=t.per_device_train_batch_size,
        per_device_eval_batch_size=t.per_device_eval_batch_size,
        gradient_accumulation_steps=eff.gradient_accumulation_steps,
        num_train_epochs=t.num_train_epochs,
        max_steps=t.max_steps,
        learning_rate=t.learning_rate,
        weight_decay=t.weight_decay,
        max_grad_norm=t.max_grad_norm,
        seed=t.seed,
        logging_steps=t.logging_steps,
        eval_strategy=t.eval_strategy if ctx.data.eval is not None else "no",
        eval_steps=t.eval_steps,
        save_strategy="steps",
        save_steps=t.save_steps,
        # Rotation is trainjobs' own (on_save): the same rule as the accelerate loop's, keeping the best.
        save_total_limit=None,
        bf16=eff.mixed_precision == "bf16",
        fp16=eff.mixed_precision == "fp16",
        use_cpu=on_cpu,
        # Naming a backend makes accelerate set up a process group, so only under torchrun.
        ddp_backend="gloo" if on_cpu and several else None,
        dataloader_num_workers=t.dataloader_num_workers,
        train_sampling_strategy="group_by_length" if spec.preprocessing.group_by_length else "random",
        length_column_name=LENGTH_COLUMN,
        report_to=backend_trackers(spec) or "none",  # W&B and MLflow: trainer_core/trackers.py
        # Trainer loads the best checkpoint at the end, found by the same rule as
        # trainer_core/best_checkpoint.py (which rotation keeps and each checkpoint describes).
        metric_for_best_model=t.best_metric if t.keeps_best else None,
        greater_is_better=t.best_higher_is_better if t.keeps_best else None,
        load_best_model_at_end=t.load_best_model_at_end,
        disable_tqdm=True,
        # Trainer's NaN filter reads the loss on the host every step: a device sync per step.
        logging_nan_inf_filter=False,
        # Preference rows reach their collator whole (chosen_*/rejected_*, reference log-probs).
        remove_unused_columns=not spec.is_preference,
    )


def train_with_trainer(ctx: RunContext) -> BackendResult:
    """Train ``ctx.spec`` with 🤗 Trainer, passing trainjobs' optimizer and scheduler."""
    spec, data = ctx.spec, ctx.data
    args = training_arguments(ctx)
    fresh = ctx.resume_from is None
    model = build_training_model(spec, data.labels, fresh=fresh)
    optimizer = build_optimizer(model, spec.optimizer, spec.training.learning_rate, spec.training.weight_decay)
    start_optimizer(spec, optimizer, fresh)
    lengths = column_lengths(data.train) if spec.preprocessing.group_by_length else None
    eval_lengths = column_lengths(data.eval) if data.eval is not None else None
    plan = plan_steps(spec, batches_per_epoch(len(data.train), args.per_device_train_batch_size, world_size()))
    scheduler = build_scheduler(spec, optimizer, plan.total_steps)
    callback = _RunCallback(ctx)
    num_labels = len(data.labels)

    def metrics_fn(prediction: EvalPrediction) -> dict[str, float]:
        preds = np.asarray(prediction.predictions)
        return compute_metrics(list(spec.metrics), preds, np.asarray(prediction.label_ids), num_labels)

    language_model = spec.task == "causal-lm"  # scored by its loss: Trainer then keeps no logits
    trainer = _SeededOrderTrainer(
        model=model,
        args=args,
        data_collator=collator_for(data.collator, model, ctx.emit),
        train_dataset=data.train,
        eval_dataset=data.eval,
        compute_metrics=None if language_model else metrics_fn,
        callbacks=[callback],
        optimizers=(optimizer, scheduler),
        preprocess_logits_for_metrics=None if language_model else _argmax_logits,
        train_lengths=lengths,
        eval_lengths=eval_lengths,
    )
    # Classification heads return a per-batch mean loss and ignore `num_items_in_batch`; a forward
    # that merely takes **kwargs makes Trainer assume otherwise and skip dividing by the accumulation
    # steps, which would scale accumulated gradients by that factor.
    trainer.model_accepts_loss_kwargs = False
    # With tqdm off, Trainer prints every log dict to stdout, which is the event stream under --jsonl.
    trainer.remove_callback(PrinterCallback)
    if spec.is_preference:
        _start_preference(trainer, ctx, model)
    elif spec.efficiency.chunked_loss:  # the SFT loss from the shared objective, in chunks
        trainer.objective, _ = start_objective(ctx, model, trainer.accelerator)
    started = time.perf_counter()
    train_loss = _train_or_restore(trainer, ctx, plan.total_steps)
    runtime = time.perf_counter() - started
    global_step = trainer.state.global_step
    train = train_summary(runtime, trainer.samples_seen * world_size(), train_loss) | callback.events.early.summary()
    if callback.cancelled:
        return BackendResult(status="cancelled", global_step=global_step, train=train)
    load_best = spec.training.load_best_model_at_end  # Trainer loaded the best checkpoint's weights
    if data.eval is not None and callback.events.eval_step != global_step and not load_best:
        trainer.evaluate()
    trainer.save_model(str(ctx.output_dir))
    if trainer.is_world_process_zero():
        save_final_extras(spec, model, data.processor, ctx.output_dir)
    final_eval = callback.events.final_eval(load_best)
    return BackendResult(status="succeeded", global_step=global_step, eval_metrics=final_eval, train=train)


def _start_preference(trainer: _SeededOrderTrainer, ctx: RunContext, model: nn.Module) -> None:
    """DPO/ORPO: the objective and its reference, once the model is on its device and before Trainer
    prepares it; the rows without ``length`` (the sampler has the lengths; the collator takes the rest)."""
    trainer.objective, data = start_objective(ctx, model, trainer.accelerator)
    trainer.train_dataset = without_length(data.train)
    trainer.eval_dataset = without_length(data.eval) if data.eval is not None else None


def _train_or_restore(trainer: Trainer, ctx: RunContext, total_steps: int) -> float | None:
    """Train (resuming when asked); the mean training loss of this session's steps.

    A checkpoint taken at the last step (the run was killed before it reported done) is restored,
    not trained from: Trainer checks ``max_steps`` only after a step, so it would train one too many.
    """
    if ctx.resume_from is not None and read_progress(ctx.resume_from).global_step >= total_steps:
        trainer._load_from_checkpoint(str(ctx.resume_from))
        trainer.state = TrainerState.load_from_json(str(ctx.resume_from / TRAINER_STATE_NAME))
        return None
    output = trainer.train(resume_from_checkpoint=str(ctx.resume_from) if ctx.resume_from else None)
    loss = output.metrics.get("train_loss")
    return float(loss) if loss is not None else None


def _argmax_logits(logits: Any, labels: torch.Tensor) -> torch.Tensor:
    # Keep only class ids on device: Trainer would otherwise gather and hold every logit row.
    if isinstance(logits, tuple):
        logits = logits[0]
    result: torch.Tensor = logits.argmax(dim=-1)
    return result
