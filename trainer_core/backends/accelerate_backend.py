"""The hand-written ``Accelerator`` loop: read it top to bottom like accelerate's
``examples/by_feature/local_sgd.py``.

Data -> model -> objective (the loss: the model's own, or DPO/ORPO's with its reference,
trainer_core/backends/objective.py) -> optimizer (trainjobs' own) -> ``prepare`` -> one visible step (``accumulate``,
``backward``, clipping, optimizer and scheduler step, ``zero_grad``, ``LocalSGD`` step) with the
bookkeeping (:class:`_Bookkeeping`: events, evaluation, checkpoints, stop) called around it ->
evaluation under ``torch.no_grad`` with ``gather_for_metrics``. Host syncs (``.item()``) happen only
at logging and evaluation points.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.local_sgd import LocalSGD
from accelerate.optimizer import AcceleratedOptimizer
from datasets import Dataset
from torch import nn
from torch.utils.data import DataLoader

from trainer_core.backends.common import (
    RunEvents,
    StepPlan,
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
from trainer_core.optimizers import build_optimizer
from trainer_core.sharding import full_model_state, load_sharded, save_sharded, shard_model

logger = logging.getLogger(__name__)


def whole(norm: torch.Tensor) -> torch.Tensor:
    """The gradient norm as a plain tensor (under FSDP clipping returns a DTensor, reduced over the shards)."""
    from torch.distributed.tensor import DTensor

    return norm.full_tensor() if isinstance(norm, DTensor) else norm


def _without_lengths(dataset: Dataset) -> tuple[Dataset, list[int] | None]:
    """The dataset the model sees (no ``length`` column) and the lengths for grouping."""
    return without_length(dataset), column_lengths(dataset)


def _dataloaders(ctx: RunContext, collator: Any) -> tuple[DataLoader, DataLoader | None]:
    spec, data = ctx.spec, ctx.data
    train_ds, lengths = _without_lengths(data.train)
    group = spec.training.per_device_train_batch_size * spec.efficiency.gradient_accumulation_steps
    sampler = EpochSampler(
        len(train_ds), spec.training.seed, group, lengths if spec.preprocessing.group_by_length else None
    )
    common: dict[str, Any] = {
        "collate_fn": collator,
        "num_workers": spec.training.dataloader_num_workers,
        "pin_memory": torch.cuda.is_available(),
    }
    # Own generators: creating a loader iterator must not draw from the global RNG (resume determinism).
    train_dl = DataLoader(
        train_ds,
        batch_size=spec.training.per_device_train_batch_size,
        sampler=sampler,
        generator=torch.Generator().manual_seed(spec.training.seed),
        **common,
    )
    eval_dl = None
    if data.eval is not None:
        eval_ds, eval_lengths = _without_lengths(data.eval)
        eval_dl = DataLoader(
            eval_ds,
            batch_size=spec.training.per_device_eval_batch_size,
            sampler=eval_order(eval_lengths, len(eval_ds)),
            generator=torch.Generator().manual_seed(spec.training.seed),
            **common,
        )
    return train_dl, eval_dl


def evaluate(
    accelerator: Accelerator, model: nn.Module, eval_dl: DataLoader, ctx: RunContext, objective: Objective
) -> dict[str, float]:
    """Loss and metrics over the whole eval split, gathered from every process.

    A causal LM is scored by its loss alone (and the perplexity derived from it): no logits are kept.
    A preference run is scored by its objective: the loss and the reward metrics, weighted by pairs.
    """
    spec = ctx.spec
    scores_predictions = spec.task != "causal-lm"
    model.eval()
    losses, preds, refs, rewards = [], [], [], []
    with torch.no_grad():
        for batch in eval_dl:
            if spec.is_preference:
                pair_loss, metrics = objective(model, batch)
                pairs = batch_samples(spec, batch)
                rows, loss = accelerator.gather_for_metrics(
                    (per_example(metrics, pairs, spec.reward_metrics), pair_loss.detach().float().repeat(pairs))
                )
                rewards.append(rows)
                losses.append(loss)
                continue
            labels = batch["labels"]
            if scores_predictions:
                out = model(**batch)
                # Weight each batch's mean loss by its size, as Trainer does.
                loss = out.loss.detach().float().repeat(labels.shape[0])
                pred, ref, loss = accelerator.gather_for_metrics((out.logits.argmax(-1), labels, loss))
                preds.append(pred)
                refs.append(ref)
            else:  # a causal LM: its loss alone, from the objective (chunked when the run's is)
                loss = objective(model, batch)[0].detach().float().repeat(labels.shape[0])
                loss = accelerator.gather_for_metrics(loss)
            losses.append(loss)
    model.train()
    return eval_values(
        ctx.spec,
        torch.cat(preds).cpu().numpy() if preds else None,
        torch.cat(refs).cpu().numpy() if refs else None,
        len(ctx.data.labels),
        float(torch.cat(losses).mean().item()),
        reward_means(torch.cat(rewards).cpu(), spec.reward_metrics) if rewards else None,
    )


def _save_checkpoint(book: _Bookkeeping, progress: TrainProgress, epoch: float) -> None:
    accelerator, ctx = book.accelerator, book.ctx
    ckpt = checkpoint_dir(ctx.output_dir, progress.global_step)
    accelerator.save_state(str(ckpt))  # every rank: each saves its own RNG state
    if ctx.spec.fsdp_settings is not None:  # the model and optimizer are not accelerate's: their shards
        # several nodes: gathered whole on rank 0, or each node's disk would hold only its ranks' part
        save_sharded(ckpt, book.model, book.optimizer.optimizer, gathered=ctx.spec.resources.num_nodes > 1)
    # Every rank tracks the best checkpoint (each may load it at the end); the main one describes it.
    evaluations = book.events.checkpoint_written(progress.global_step)
    if accelerator.is_main_process:
        # What from_pretrained needs beside save_state's weights, so that a checkpoint loads on its own:
        # the config (an adapter: its own files, save_state keeps only the trainable tensors), the tokenizer.
        model: Any = book.unwrapped  # a transformers model, or a PEFT one
        if ctx.spec.adapter is not None:
            model.save_pretrained(str(ckpt))  # adapter_model.safetensors, adapter_config.json
        else:
            model.config.save_pretrained(str(ckpt))
        save_processor(ctx.data.processor, ckpt)
        keep_reference_logps(ctx.spec, ctx.output_dir, ckpt)
        write_meta(ckpt, ctx.spec, progress, "accelerate", evaluations)
        book.events.checkpoint_saved(progress.global_step, epoch)
        rotate_checkpoints(ctx.output_dir, ctx.spec.training.save_total_limit, book.events.best.protected())
    accelerator.wait_for_everyone()


def _adapter_checkpoints(accelerator: Accelerator) -> None:
    """Checkpoints of an adapter run hold the trainable tensors only (see ``trainable_state``)."""
    from trainer_core.adapters import trainable_state

    def keep_trainable(models: list[nn.Module], weights: list[dict[str, Any]], output_dir: str) -> None:
        for i, model in enumerate(models):
            weights[i] = trainable_state(model)

    accelerator.register_save_state_pre_hook(keep_trainable)


def _load_state(accelerator: Accelerator, ctx: RunContext, checkpoint: Path, model: nn.Module, optimizer: Any) -> None:
    """A checkpoint's state into this run: accelerate's (RNG, sampler, scheduler; unsharded: model and
    optimizer too), then a sharded run's model and optimizer shards."""
    # An adapter run's checkpoint lacks the frozen base (rebuilt as the run started), so not strict.
    accelerator.load_state(str(checkpoint), strict=ctx.spec.adapter is None)
    if ctx.spec.fsdp_settings is not None:
        load_sharded(checkpoint, model, optimizer.optimizer)


def _load_checkpoint(accelerator: Accelerator, ctx: RunContext, model: nn.Module, optimizer: Any) -> TrainProgress:
    """Where training starts: the checkpoint's step, epoch and batch, or the very beginning."""
    if ctx.resume_from is None:
        return TrainProgress(0, 0, 0)
    start = read_progress(ctx.resume_from, ctx.spec)  # before loading: a layout it cannot go on with is refused
    _load_state(accelerator, ctx, ctx.resume_from, model, optimizer)
    logger.info("resuming from %s at step %d", ctx.resume_from, start.global_step)
    return start


@dataclass
class _Bookkeeping:
    """Everything around the training step: counters, events, evaluations, checkpoints, the stop check.

    Loss and gradient norm stay on the device as tensors; they are read (a host sync) only when a
    ``metric`` event is due, and once at the end for the train summary.
    """

    ctx: RunContext
    accelerator: Accelerator
    model: nn.Module
    optimizer: Any
    scheduler: Any
    eval_dl: DataLoader | None
    plan: StepPlan
    objective: Objective
    global_step: int = 0
    grad_norm: torch.Tensor | None = None
    loss_sum: torch.Tensor | None = None  # since the last metric event
    loss_count: int = 0
    loss_total: torch.Tensor | None = None  # this session, for the train summary
    batches: int = 0
    samples: int = 0
    rewards: MetricWindow = field(default_factory=MetricWindow)  # a preference run's, since the last metric event
    events: RunEvents = field(init=False)
    unwrapped: nn.Module = field(init=False)

    def __post_init__(self) -> None:
        self.events = RunEvents(self.ctx.emit, self.ctx.spec, self.ctx.resume_from)
        self.unwrapped = self.accelerator.unwrap_model(self.model)

    @property
    def finished(self) -> bool:
        """The last step is done, or early stopping ended training at the evaluation just made."""
        return self.global_step >= self.plan.total_steps or self.events.stop_early

    def after_batch(self, batch: dict[str, torch.Tensor], loss: torch.Tensor, metrics: dict[str, torch.Tensor]) -> None:
        """Count a micro-batch's examples and add its loss and metrics, without a host sync."""
        self.samples += batch_samples(self.ctx.spec, batch)
        self.rewards.add(metrics)
        detached = loss.detach().float()
        self.loss_sum = detached if self.loss_sum is None else self.loss_sum + detached
        self.loss_total = detached if self.loss_total is None else self.loss_total + detached
        self.loss_count += 1
        self.batches += 1

    def after_update(self, epoch: int, batch_index: int) -> bool:
        """After an optimizer step: events, step evaluation, checkpoint; True when asked to stop early."""
        t = self.ctx.spec.training
        self.global_step += 1
        epoch_float = epoch + batch_index / self.plan.batches_per_epoch
        self.events.step_done(self.unwrapped, self.optimizer, self.global_step, self.plan.total_steps, epoch_float)
        if self.global_step % t.logging_steps == 0 and self.loss_sum is not None:
            values = {
                "loss": self.loss_sum.item() / self.loss_count,
                "learning_rate": self.scheduler.get_last_lr()[0],
                "grad_norm": None if self.grad_norm is None else float(self.grad_norm),
                **self.rewards.means(self.accelerator),
            }
            self.events.metric(self.global_step, epoch_float, values)
            self._report(values)
            self.loss_sum, self.loss_count = None, 0
        if t.eval_strategy == "steps" and self.global_step % (t.eval_steps or t.logging_steps) == 0:
            self.evaluate(epoch_float)
        stop = self.ctx.stop.requested_by_any(self.accelerator.device)
        if self.global_step % t.save_steps == 0 or self.finished or stop:
            at_end = batch_index >= self.plan.batches_per_epoch
            where = (epoch + 1, 0) if at_end else (epoch, batch_index)
            _save_checkpoint(self, TrainProgress(self.global_step, *where), epoch_float)
        return stop and not self.finished

    def evaluate(self, epoch_float: float) -> None:
        if self.eval_dl is None:
            return
        values = evaluate(self.accelerator, self.model, self.eval_dl, self.ctx, self.objective)
        self.events.evaluated(self.global_step, epoch_float, values)
        self._report(values)

    def _report(self, values: dict[str, Any]) -> None:
        """Mirror a metric or eval point to TensorBoard (``training.report_to``), if asked."""
        if backend_trackers(self.ctx.spec):
            self.accelerator.log({k: v for k, v in values.items() if v is not None}, step=self.global_step)

    def summary(self, runtime_s: float) -> dict[str, Any]:
        mean_loss = None if self.loss_total is None else self.loss_total.item() / self.batches
        return train_summary(runtime_s, self.samples * self.accelerator.num_processes, mean_loss) | (
            self.events.early.summary()
        )


def train_with_accelerate(ctx: RunContext) -> BackendResult:
    """Train ``ctx.spec`` with a hand-written Accelerator loop."""
    spec, t, eff = ctx.spec, ctx.spec.training, ctx.spec.efficiency
    trackers = backend_trackers(spec)
    accelerator = Accelerator(
        gradient_accumulation_steps=eff.gradient_accumulation_steps,
        mixed_precision=eff.mixed_precision,
        cpu=not torch.cuda.is_available(),  # without it, torchrun workers on CPU would not form a group
        # the same place Trainer's TensorBoard callback writes to: <output_dir>/runs
        log_with=trackers or None,
        project_dir=str(ctx.output_dir),
    )
    if trackers:
        accelerator.init_trackers("runs", config={"spec": spec.model_dump_json()})
    fresh = ctx.resume_from is None
    model = build_training_model(spec, ctx.data.labels, fresh=fresh)
    # Before `prepare`: a preference run's reference is the starting model (and a precomputed one its rows').
    objective, data = start_objective(ctx, model, accelerator)
    ctx = replace(ctx, data=data)
    if spec.fsdp_settings is not None:
        shard_model(model, spec, accelerator.device)  # before the optimizer: it steps the shards
    optimizer = build_optimizer(model, spec.optimizer, t.learning_rate, t.weight_decay)
    start_optimizer(spec, optimizer, fresh)
    train_dl, eval_dl = _dataloaders(ctx, collator_for(ctx.data.collator, model, ctx.emit))
    if spec.fsdp_settings is None:
        model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)
    else:
        # A sharded model is not accelerate's to wrap (on the CPU it would add DDP around it); its optimizer
        # is wrapped only to step when the accumulation window closes, and saved as shards, not by accelerate.
        optimizer = AcceleratedOptimizer(optimizer, device_placement=False)
        train_dl = accelerator.prepare(train_dl)
    if eval_dl is not None:
        eval_dl = accelerator.prepare(eval_dl)
    plan = plan_steps(spec, batches_per_epoch(len(ctx.data.train), t.per_device_train_batch_size,
                                              accelerator.num_processes))
    # Not prepared, unlike the example: plan_steps already counts updates per process, so it steps
    # once per update (a prepared scheduler would step num_processes times).
    scheduler = build_scheduler(spec, optimizer.optimizer, plan.total_steps)
    accelerator.register_for_checkpointing(scheduler)
    if spec.adapter is not None:
        _adapter_checkpoints(accelerator)
    start = _load_checkpoint(accelerator, ctx, model, optimizer)
    book = _Bookkeeping(
        ctx, accelerator, model, optimizer, scheduler, eval_dl, plan, objective, global_step=start.global_step
    )

    cancelled = False
    started = time.perf_counter()
    model.train()
    with LocalSGD(accelerator, model, eff.local_sgd_steps or 1, enabled=eff.local_sgd_steps is not None) as local_sgd:
        for epoch in range(start.epoch, plan.num_epochs):
            if book.finished:
                break
            # Through the loader: accelerate's loader re-applies its own epoch counter on every
            # iteration, which starts at 0 in a resumed process.
            train_dl.set_epoch(epoch)
            skip = start.batch_in_epoch if epoch == start.epoch else 0
            batch_index = skip
            for batch in accelerator.skip_first_batches(train_dl, skip) if skip else train_dl:
                batch_index += 1
                with accelerator.accumulate(model):
                    loss, metrics = objective(model, batch)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients and t.max_grad_norm > 0:
                        book.grad_norm = whole(accelerator.clip_grad_norm_(model.parameters(), t.max_grad_norm))
                    optimizer.step()  # a no-op until the accumulation window closes
                    if accelerator.sync_gradients:
                        scheduler.step()  # not prepared (see above), so only when the optimizer stepped
                    optimizer.zero_grad(set_to_none=True)
                    if accelerator.sync_gradients:
                        local_sgd.step()  # counts optimizer steps, not micro-batches: local_sgd_steps means updates
                book.after_batch(batch, loss, metrics)
                if accelerator.sync_gradients:
                    cancelled = book.after_update(epoch, batch_index)
                    if cancelled or book.finished:
                        break
            if cancelled:
                break
            if batch_index >= plan.batches_per_epoch and t.eval_strategy == "epoch":
                book.evaluate(float(epoch + 1))
    runtime = time.perf_counter() - started

    if trackers:
        accelerator.end_training()
    load_best = t.load_best_model_at_end and book.events.best.step is not None
    if not cancelled:
        if load_best:
            _load_best(accelerator, ctx, book, optimizer)
        elif book.events.eval_step != book.global_step:
            book.evaluate(float(plan.num_epochs))
        _save_final(accelerator, model, ctx)
    return BackendResult(
        status="cancelled" if cancelled else "succeeded",
        global_step=book.global_step,
        eval_metrics=book.events.final_eval(load_best and not cancelled),
        train=book.summary(runtime),
    )


def _load_best(accelerator: Accelerator, ctx: RunContext, book: _Bookkeeping, optimizer: Any) -> None:
    """``load_best_model_at_end``: the best checkpoint's weights become the model saved as final (its
    optimizer and scheduler state come along, unused: training is over)."""
    step = book.events.best.step
    if step is None or step == book.global_step:
        return  # the model in memory is the best one
    logger.info("loading the best checkpoint (step %d, %s %s)", step, book.events.best.key, book.events.best.value)
    _load_state(accelerator, ctx, checkpoint_dir(ctx.output_dir, step), book.model, optimizer)


def _save_final(accelerator: Accelerator, model: nn.Module, ctx: RunContext) -> None:
    accelerator.wait_for_everyone()
    # A sharded model's weights are gathered whole first (every rank takes part; rank 0 gets them).
    state = full_model_state(model) if ctx.spec.fsdp_settings is not None else None
    if accelerator.is_main_process:
        unwrapped = accelerator.unwrap_model(model)
        unwrapped.save_pretrained(str(ctx.output_dir), state_dict=state)  # a PEFT model writes its adapter only
        save_final_extras(ctx.spec, unwrapped, ctx.data.processor, ctx.output_dir)
    accelerator.wait_for_everyone()

