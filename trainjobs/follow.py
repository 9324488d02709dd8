"""Following a job from the terminal: a live tqdm bar (step, epoch, ETA, last loss, eval metrics).

The bar is fed by :meth:`Client.events`, which resumes a dropped stream with the last event id, so a
restart of the API shows up as a pause, not as repeated or missing steps.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, TextIO

from tqdm import tqdm

from service_core.status import exit_code
from trainjobs.client import TERMINAL, Client
from trainjobs.sse import SseEvent


def _short(values: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    out = {}
    for key, value in values.items():
        if isinstance(value, float):
            out[prefix + key] = f"{value:.4g}"
        elif isinstance(value, int | str):
            out[prefix + key] = str(value)
    return out


def describe(event: SseEvent) -> str:
    """One line for one event, the form ``jobs logs`` prints."""
    data: Mapping[str, Any] = event.data if isinstance(event.data, Mapping) else {"message": event.data}
    head = f"[{event.id or '-'}] {data.get('time', '')} {event.event}"
    if event.event == "status":
        extra = " ".join(str(data[k]) for k in ("status", "reason", "message") if data.get(k))
        return f"{head} {extra}"
    if event.event == "log":
        return f"{head} {data.get('message', '')}"
    parts = [f"step={data['step']}"] if "step" in data else []
    if isinstance(data.get("epoch"), int | float):
        parts.append(f"epoch={data['epoch']:.2f}")
    if isinstance(data.get("values"), Mapping):
        parts += [f"{k}={v}" for k, v in _short(data["values"]).items()]
    if isinstance(data.get("loss"), int | float):  # a checkpoint's
        parts.append(f"loss={data['loss']:.4g}")
    if "total_steps" in data:
        parts.append(f"total={data['total_steps']}")
    return f"{head} {' '.join(parts)}"


class ProgressView:
    """Renders events into one tqdm bar; status changes and logs are written above it."""

    def __init__(self, stream: TextIO | None = None):
        self.stream = stream or sys.stderr
        self.bar = tqdm(total=None, unit="step", file=self.stream, dynamic_ncols=True, leave=True)
        self.postfix: dict[str, str] = {}
        self.final: dict[str, Any] | None = None

    def update(self, event: SseEvent) -> None:
        data: Mapping[str, Any] = event.data if isinstance(event.data, Mapping) else {}
        if event.event == "progress":
            total = data.get("total_steps")
            if isinstance(total, int) and total > 0 and self.bar.total != total:
                self.bar.total = total
            step = data.get("step")
            if isinstance(step, int) and step >= self.bar.n:
                self.bar.update(step - self.bar.n)
            if isinstance(data.get("epoch"), int | float):
                self.postfix["epoch"] = f"{data['epoch']:.2f}"
        elif event.event == "metric" and isinstance(data.get("values"), Mapping):
            loss = data["values"].get("loss")
            if isinstance(loss, int | float):
                self.postfix["loss"] = f"{loss:.4g}"
        elif event.event == "eval" and isinstance(data.get("values"), Mapping):
            self.postfix.update(_short(data["values"], "" if "eval_" in "".join(data["values"]) else "eval_"))
        elif event.event in ("status", "log"):
            self.bar.write(describe(event), file=self.stream)
            if event.event == "status" and data.get("status") in TERMINAL:
                self.final = dict(data)
        self.bar.set_postfix(self.postfix, refresh=True)

    def close(self) -> None:
        self.bar.close()


def follow(client: Client, job_id: str, stream: TextIO | None = None) -> int:
    """Show the job live until it ends; returns its exit status (:data:`service_core.status.EXIT_CODES`)."""
    view = ProgressView(stream)
    try:
        for event in client.events(job_id):
            view.update(event)
    finally:
        view.close()
    status = view.final["status"] if view.final else client.get(job_id)["status"]
    return exit_code(str(status))
