"""The hand-written ``Accelerator`` loop: read it top to bottom like accelerate's nlp_example.

Data -> model -> optimizer (trainjobs' own) -> ``prepare`` -> loop with ``accumulate`` / ``backward`` /
clipping / optional ``LocalSGD`` -> evaluation under ``torch.no_grad`` with ``gather_for_metrics``.
Host syncs (``.item()``) happen only at logging and evaluation points.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.local_sgd import LocalSGD
from datasets import Dataset
from torch import nn
from torch.utils.data import DataLoader

from trainer_core.backends import BackendResult, RunContext
from trainer_core.backends.common import (
    LENGTH_COLUMN,
    StepPlan,
    build_scheduler,
    build_training_model,
    column_lengths,
    eval_values,
    plan_steps,
    save_processor,
)
from trainer_core.backends.sampling import EpochSampler, eval_order
from trainer_core.checkpoint import (
    TrainProgress,
    checkpoint_dir,
    read_progress,
    rotate_checkpoints,
    write_meta,
)
from trainer_core.events import make_event
from trainer_core.memory_report import memory_event
from trainer_core.optimizers import build_optimizer

logger = logging.getLogger(__name__)


def _without_lengths(dataset: Dataset) -> tuple[Dataset, list[int] | None]:
    """The dataset the model sees (no ``length`` column) and the lengths for grouping."""
    lengths = column_lengths(dataset)
    return (dataset if lengths is None else dataset.remove_columns(LENGTH_COLUMN)), lengths


def _dataloaders(ctx: RunContext) -> tuple[DataLoader, DataLoader | None]:
    spec, data = ctx.spec, ctx.data
    train_ds, lengths = _without_lengths(data.train)
    group = spec.training.per_device_train_batch_size * spec.efficiency.gradient_accumulation_steps
    sampler = EpochSampler(
        len(train_ds), spec.training.seed, group, lengths if spec.preprocessing.group_by_length else None
    )
    common: dict[str, Any] = {
        "collate_fn": data.collator,
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
    accelerator: Accelerator, model: nn.Module, eval_dl: DataLoader, ctx: RunContext
) -> dict[str, float]:
    """Loss and metrics over the whole eval split, gathered from every process."""
    model.eval()
    losses, preds, refs = [], [], []
    with torch.no_grad():
        for batch in eval_dl:
            out = model(**batch)
            labels = batch["labels"]
            # Weight each batch's mean loss by its size, as Trainer does.
            loss = out.loss.detach().float().repeat(labels.shape[0])
            pred, ref, loss = accelerator.gather_for_metrics((out.logits.argmax(-1), labels, loss))
            preds.append(pred)
            refs.append(ref)
            losses.append(loss)
    model.train()
    return eval_values(
        ctx.spec,
        torch.cat(preds).cpu().numpy(),
        torch.cat(refs).cpu().numpy(),
        len(ctx.data.labels),
        float(torch.cat(losses).mean().item()),
    )


def _save_checkpoint(accelerator: Accelerator, ctx: RunContext, progress: TrainProgress) -> None:
    ckpt = checkpoint_dir(ctx.output_dir, progress.global_step)
    accelerator.save_state(str(ckpt))  # every rank: each saves its own RNG state
    if accelerator.is_main_process:
        write_meta(ckpt, ctx.spec, progress, "accelerate")
        rotate_checkpoints(ctx.output_dir, ctx.spec.training.save_total_limit)
    accelerator.wait_for_everyone()


@dataclass
class _Loop:
    """The live objects of one run and the counters between log points.

    Loss and gradient norm stay on the device as tensors; they are read (a host sync) only when a
    ``metric`` event is due.
    """

    ctx: RunContext
    accelerator: Accelerator
    model: nn.Module
    optimizer: Any
    scheduler: Any
    eval_dl: DataLoader | None
    plan: StepPlan
    global_step: int = 0
    loss_sum: torch.Tensor | None = None
    loss_count: int = 0
    samples: int = 0
    grad_norm: torch.Tensor | None = None
    memory_sent: bool = False
    last_eval: dict[str, float] = field(default_factory=dict)
    eval_step: int = -1

    def train_batch(self, batch: dict[str, torch.Tensor]) -> None:
        t = self.ctx.spec.training
        with self.accelerator.accumulate(self.model):
            loss = self.model(**batch).loss
            self.accelerator.backward(loss)
            if self.accelerator.sync_gradients and t.max_grad_norm > 0:
                self.grad_norm = self.accelerator.clip_grad_norm_(self.model.parameters(), t.max_grad_norm)
            self.optimizer.step()  # a no-op until the accumulation window closes
            self.optimizer.zero_grad(set_to_none=True)
        self.samples += int(batch["labels"].shape[0])
        detached = loss.detach().float()
        self.loss_sum = detached if self.loss_sum is None else self.loss_sum + detached
        self.loss_count += 1

    def after_update(self, epoch_float: float) -> None:
        """Bookkeeping after an optimizer step: memory (once), progress, metrics, step evaluation."""
        t, emit = self.ctx.spec.training, self.ctx.emit
        if not self.memory_sent:
            emit(memory_event(self.accelerator.unwrap_model(self.model), self.optimizer))
            self.memory_sent = True
        emit(make_event("progress", step=self.global_step, total_steps=self.plan.total_steps, epoch=epoch_float))
        if self.global_step % t.logging_steps == 0 and self.loss_sum is not None:
            values = {
                "loss": self.loss_sum.item() / self.loss_count,
                "learning_rate": self.scheduler.get_last_lr()[0],
                "grad_norm": None if self.grad_norm is None else float(self.grad_norm),
            }
            emit(make_event("metric", step=self.global_step, epoch=epoch_float, values=values))
            self._report(values)
            self.loss_sum, self.loss_count = None, 0
        if t.eval_strategy == "steps" and self.global_step % (t.eval_steps or t.logging_steps) == 0:
            self.evaluate(epoch_float)

    def evaluate(self, epoch_float: float) -> None:
        if self.eval_dl is None:
            return
        self.last_eval = evaluate(self.accelerator, self.model, self.eval_dl, self.ctx)
        self.eval_step = self.global_step
        self.ctx.emit(make_event("eval", step=self.global_step, epoch=epoch_float, values=self.last_eval))
        self._report(self.last_eval)

    def _report(self, values: dict[str, Any]) -> None:
        """Mirror a metric or eval point to the user's trackers (``training.report_to``), if any."""
        if self.ctx.spec.training.report_to:
            self.accelerator.log({k: v for k, v in values.items() if v is not None}, step=self.global_step)

    def run_epoch(self, epoch: int, skip: int, train_dl: DataLoader, sgd: LocalSGD) -> tuple[bool, bool]:
        """Train one epoch from batch ``skip``; returns (stopped on request, epoch completed)."""
        t = self.ctx.spec.training
        loader = self.accelerator.skip_first_batches(train_dl, skip) if skip else train_dl
        batch_index = skip
        for batch in loader:
            self.train_batch(batch)
            batch_index += 1
            if not self.accelerator.sync_gradients:
                continue
            self.scheduler.step()
            sgd.step()
            self.global_step += 1
            self.after_update(epoch + batch_index / self.plan.batches_per_epoch)
            finished = self.global_step >= self.plan.total_steps
            stop = self.ctx.stop.requested_by_any(self.accelerator.device)
            if self.global_step % t.save_steps == 0 or finished or stop:
                at_end = batch_index >= self.plan.batches_per_epoch
                where = (epoch + 1, 0) if at_end else (epoch, batch_index)
                _save_checkpoint(self.accelerator, self.ctx, TrainProgress(self.global_step, *where))
            if stop and not finished:
                return True, False
            if finished:
                break
        return False, batch_index >= self.plan.batches_per_epoch


def train_with_accelerate(ctx: RunContext) -> BackendResult:
    """Train ``ctx.spec`` with a hand-written Accelerator loop."""
    spec, t, eff = ctx.spec, ctx.spec.training, ctx.spec.efficiency
    accelerator = Accelerator(
        gradient_accumulation_steps=eff.gradient_accumulation_steps,
        mixed_precision=eff.mixed_precision,
        cpu=not torch.cuda.is_available(),  # without it, torchrun workers on CPU would not form a group
        # the same place Trainer's TensorBoard callback writes to: <output_dir>/runs
        log_with=list(t.report_to) or None,
        project_dir=str(ctx.output_dir),
    )
    if t.report_to:
        accelerator.init_trackers("runs", config={"spec": spec.model_dump_json()})
    model = build_training_model(spec, ctx.data.labels)
    optimizer = build_optimizer(model, spec.optimizer, t.learning_rate, t.weight_decay)
    train_dl, eval_dl = _dataloaders(ctx)
    model, optimizer, train_dl = accelerator.prepare(model, optimizer, train_dl)
    if eval_dl is not None:
        eval_dl = accelerator.prepare(eval_dl)
    plan = plan_steps(spec, len(train_dl))
    # Not prepared: steps are counted on the sharded loader already, so it must step once per update.
    scheduler = build_scheduler(spec, optimizer.optimizer, plan.total_steps)
    accelerator.register_for_checkpointing(scheduler)

    start = TrainProgress(0, 0, 0)
    if ctx.resume_from is not None:
        accelerator.load_state(str(ctx.resume_from))
        start = read_progress(ctx.resume_from)
        logger.info("resuming from %s at step %d", ctx.resume_from, start.global_step)
    loop = _Loop(ctx, accelerator, model, optimizer, scheduler, eval_dl, plan, global_step=start.global_step)
    cancelled = False
    started = time.perf_counter()
    model.train()
    with LocalSGD(accelerator, model, eff.local_sgd_steps or 1, enabled=eff.local_sgd_steps is not None) as sgd:
        for epoch in range(start.epoch, plan.num_epochs):
            if loop.global_step >= plan.total_steps:
                break
            # Through the loader: accelerate's loader re-applies its own epoch counter on every
            # iteration, which starts at 0 in a resumed process.
            train_dl.set_epoch(epoch)
            skip = start.batch_in_epoch if epoch == start.epoch else 0
            cancelled, completed = loop.run_epoch(epoch, skip, train_dl, sgd)
            if cancelled:
                break
            if completed and t.eval_strategy == "epoch":
                loop.evaluate(float(epoch + 1))
    runtime = time.perf_counter() - started
    if t.report_to:
        accelerator.end_training()
    if not cancelled:
        if loop.eval_step != loop.global_step:
            loop.evaluate(float(plan.num_epochs))
        _save_final(accelerator, model, ctx)
    samples = loop.samples * accelerator.num_processes
    train = {"train_runtime_s": runtime, "train_samples": samples, "train_samples_per_second": samples / runtime}
    return BackendResult(
        status="cancelled" if cancelled else "succeeded",
        global_step=loop.global_step,
        eval_metrics=loop.last_eval,
        train=train,
    )


def _save_final(accelerator: Accelerator, model: nn.Module, ctx: RunContext) -> None:
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        accelerator.unwrap_model(model).save_pretrained(str(ctx.output_dir))
        save_processor(ctx.data.processor, ctx.output_dir)
    accelerator.wait_for_everyone()

