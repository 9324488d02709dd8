"""Helpers for the run tests: specs on generated data, in-process runs, reloading a saved model."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import IO, Any

import numpy as np
import torch
from safetensors.torch import load_file
from torch.utils.data import DataLoader

from tests.trainer_core import datagen
from trainer_core.backends.common import build_training_model
from trainer_core.data import PreparedData, prepare_data
from trainer_core.events import Event, EventCollector, parse_event_line
from trainer_core.launch import why_ranks_are_not_forked
from trainer_core.memory_report import memory_values
from trainer_core.metrics import compute_metrics
from trainer_core.modeling import MODEL_CLASSES
from trainer_core.optimizers import build_optimizer
from trainer_core.run import train_job
from trainer_core.spec import JobSpec, parse_spec
from worker.forkserver import RunProcess, start_run
from worker.run_env import run_environment

BACKENDS = ("trainer", "accelerate")
# Tiny models run an order of magnitude faster on one thread than fighting over shared cores.
torch.set_num_threads(1)
NO_DROPOUT = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0}


def text_spec(data_dir: Path, backend: str, n_train: int = 96, n_val: int = 32, **overrides: Any) -> JobSpec:
    """A tiny config-built BERT on a generated sentiment CSV, with the given backend."""
    files = datagen.write_sentiment_csv(data_dir, n_train=n_train, n_val=n_val)
    spec = datagen.tiny_text_spec(files, **overrides)
    spec.setdefault("training", {})["backend"] = backend
    return parse_spec(spec)


def run(spec: JobSpec, output_dir: Path, **kwargs: Any) -> tuple[str, EventCollector]:
    """Train ``spec`` into ``output_dir``; its status and events. In this process, where a spec of several
    processes has its ranks forked from it (trainer_core/launch.py); but where this process may not fork
    (an xdist worker holds threads earlier tests left, fsspec's event loop among them), through
    ``trainjobs train`` in a child of its own, which forks them: torchrun would otherwise start each
    rank and its launcher as new interpreters, seconds of imports each."""
    if spec.resources.num_processes == 1 or why_ranks_are_not_forked() is None:
        events = EventCollector()
        return train_job(spec, output_dir, emit=events, **kwargs), events
    assert kwargs.keys() <= {"resume"}, f"a run of several processes here takes resume alone, not {kwargs}"
    status, events, _ = cli_run(spec, output_dir, *(["--resume"] if kwargs.get("resume") else []))
    return status, events


def cli_run(spec: JobSpec, output_dir: Path, *args: str) -> tuple[str, EventCollector, str]:
    """``trainjobs train`` of ``spec`` into ``output_dir`` (and ``args``) in a child process, to its end:
    its status, its events and what it logged (stderr)."""
    output_dir.parent.mkdir(parents=True, exist_ok=True)
    spec_file = write_spec(spec, output_dir.parent / f"{output_dir.name}.spec.json")
    log = output_dir.parent / f"{output_dir.name}.stderr.log"
    events = EventCollector()
    with log.open("w") as stderr:
        for event in finish(cli_process(str(spec_file), "--output-dir", str(output_dir), "--jsonl", *args,
                                        stderr=stderr)):  # fmt: skip
            events(event)
    logged = log.read_text()
    done = events.of_kind("done")
    return (done[-1]["status"] if done else f"no done event: {logged[-3000:]}"), events, logged


def memory_after_one_step(spec: JobSpec, data: PreparedData, rows: int = 4) -> dict[str, int | None]:
    """The memory event's values for the model and optimizer a run of ``spec`` builds (both backends
    build them with these functions), after one optimizer step on ``rows`` of ``data``: no run, no
    save, no evaluation. Optimizers allocate their state on that first step."""
    model = build_training_model(spec, data.labels)
    optimizer = build_optimizer(model, spec.optimizer, spec.training.learning_rate, spec.training.weight_decay)
    batch = data.collator([data.train[i] for i in range(rows)])
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=spec.efficiency.mixed_precision == "bf16"):
        loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    return memory_values(model, optimizer)


def done_event(events: EventCollector) -> dict[str, Any]:
    done = events.of_kind("done")
    assert len(done) == 1 and events.events[-1] is done[0], "exactly one done event, and it comes last"
    return done[0]


def logged_losses(events: EventCollector) -> list[float]:
    return [e["values"]["loss"] for e in events.of_kind("metric")]


def weights(output_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(output_dir / "model.safetensors"))


def assert_same_weights(a: Path, b: Path, atol: float = 1e-5) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wa[name], wb[name], atol=atol, rtol=1e-4, msg=f"parameter {name} differs")


def evaluate_saved(spec: JobSpec, output_dir: Path) -> dict[str, float]:
    """Load the saved model and processor from ``output_dir`` and score the validation split."""
    saved = spec.model_copy(update={"model": spec.model.model_copy(update={"name_or_path": str(output_dir),
                                                                           "config": None})})
    data = prepare_data(saved, None)
    assert data.eval is not None
    model = MODEL_CLASSES[spec.task].from_pretrained(str(output_dir)).eval()
    loader = DataLoader(data.eval.remove_columns("length"), batch_size=16, collate_fn=data.collator)
    preds, refs, losses = [], [], []
    with torch.no_grad():
        for batch in loader:
            out = model(**batch)
            preds.append(out.logits.argmax(-1).numpy())
            refs.append(batch["labels"].numpy())
            losses.append(np.full(len(batch["labels"]), out.loss.item()))
    values = compute_metrics(list(spec.metrics), np.concatenate(preds), np.concatenate(refs), len(data.labels))
    return {"eval_loss": float(np.concatenate(losses).mean()), **{f"eval_{k}": v for k, v in values.items()}}


def write_spec(spec: JobSpec, path: Path) -> Path:
    path.write_text(json.dumps(spec.model_dump(mode="json")), encoding="utf-8")
    return path


def cli_process(*args: str, stderr: IO[Any] | None = None) -> RunProcess:
    """``python -m trainer_core ARGS`` (the command ``trainjobs train`` is) as a child with its events on a
    pipe, started as a worker slot starts a run (:func:`worker.forkserver.start_run`): forked from this
    process's zygote where the test asked for one (the ``warm_runs`` fixture), else a fresh interpreter.
    Callers SIGKILL it in ``finally``."""
    env = run_environment(os.environ)
    if stderr is not None:
        return start_run(list(args), env, stderr)
    with open(os.devnull, "wb") as devnull:  # the child has its own copy
        return start_run(list(args), env, devnull)


def events_until(proc: RunProcess, stop_at_step: int | None = None) -> list[Event]:
    """Events from the child's stdout, until EOF or until a progress event reaches ``stop_at_step``."""
    assert proc.stdout is not None
    events: list[Event] = []
    for line in proc.stdout:
        event = parse_event_line(line)
        if event is None:
            continue
        events.append(event)
        if stop_at_step is not None and event["event"] == "progress" and event["step"] >= stop_at_step:
            break
    return events


def finish(proc: RunProcess) -> list[Event]:
    """The child's remaining events once it exits; a child that will not exit is killed."""
    try:
        events = events_until(proc)
        proc.wait(timeout=120)
        return events
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
