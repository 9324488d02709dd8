"""Run events: one JSON object per line, the contract between a training run and whoever watches it.

Kinds (``event`` field): ``progress``, ``metric``, ``eval``, ``memory``, ``log`` (a ``message``; the
one saying how packed rows reach the model also carries ``packing``: ``rows`` or ``flattened``),
``checkpoint`` (a checkpoint complete on disk: its step, epoch and the last training loss),
``trackers`` (where the run's W&B / MLflow runs are: trainer_core/trackers.py) and ``done``. Every
event carries ``time``, a UTC ISO-8601 timestamp. The worker parses these lines from the run's stdout;
the CLI renders them as a progress bar. Only the main process emits.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, Literal, TextIO, get_args

EventKind = Literal["progress", "metric", "eval", "memory", "log", "checkpoint", "trackers", "done"]
EVENT_KINDS: tuple[str, ...] = get_args(EventKind)
RunStatus = Literal["succeeded", "failed", "cancelled"]
# Exit status of `python -m trainer_core` (and so of `trainjobs train`) for each way a run ends, and for
# a spec refused before training. service_core.status.EXIT_CODES holds the same numbers (a test ties them).
RUN_EXIT_CODES: dict[RunStatus, int] = {"succeeded": 0, "failed": 1, "cancelled": 3}
EXIT_INVALID_SPEC = 2

Event = dict[str, Any]
EventSink = Callable[[Event], None]


def utc_now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _finite(value: Any) -> Any:
    # JSON has no NaN/inf; a diverged loss is reported as null rather than breaking the stream.
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def make_event(kind: EventKind, **fields: Any) -> Event:
    event: Event = {"event": kind, "time": utc_now_iso()}
    for key, value in fields.items():
        if isinstance(value, dict):
            value = {k: _finite(v) for k, v in value.items()}
        event[key] = _finite(value)
    return event


def json_line(event: Event) -> str:
    return json.dumps(event, separators=(",", ":"), sort_keys=False)


def parse_event_line(line: str) -> Event | None:
    """The event on ``line``, or None when the line is not one (library chatter on stdout)."""
    line = line.strip()
    if not line.startswith("{"):
        return None
    try:
        event = json.loads(line)
    except json.JSONDecodeError:
        return None
    if not isinstance(event, dict) or event.get("event") not in EVENT_KINDS:
        return None
    return event


def stream_sink(stream: TextIO | None = None) -> EventSink:
    """A sink that writes each event as one flushed line (flushed so watchers see it at once)."""
    out = stream if stream is not None else sys.stdout

    def emit(event: Event) -> None:
        out.write(json_line(event) + "\n")
        out.flush()

    return emit


class EventCollector:
    """A sink that keeps events in memory, for library users and tests."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    def __call__(self, event: Event) -> None:
        self.events.append(event)

    def of_kind(self, kind: EventKind) -> list[Event]:
        return [e for e in self.events if e["event"] == kind]
