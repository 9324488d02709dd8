"""A Server-Sent Events frame parser (the WHATWG event-stream format, the subset the service speaks).

Lines are fed one at a time (``httpx.Response.iter_lines`` strips the line ending); a blank line ends
a frame. Comment lines (``:``, used as keep-alives) and unknown fields are ignored, as the spec says.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SseEvent:
    """One dispatched event: its ``id`` (the job event seq), kind and decoded JSON data."""

    id: str | None
    event: str
    data: Any

    @property
    def seq(self) -> int | None:
        """The event id as the job's event sequence number, when it is one."""
        return int(self.id) if self.id is not None and self.id.isdigit() else None


@dataclass
class SseParser:
    """Accumulates fields until a blank line, then yields the frame as an :class:`SseEvent`."""

    _event: str = ""
    _data: list[str] = field(default_factory=list)
    _id: str | None = None

    def feed(self, line: str) -> SseEvent | None:
        """Take one line (without its line ending); return an event when the line ends a frame."""
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            return None
        name, _, value = line.partition(":")
        if value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._id = value
        return None

    def _dispatch(self) -> SseEvent | None:
        if not self._data:
            self._event = ""
            return None
        raw = "\n".join(self._data)
        try:
            data: Any = json.loads(raw)
        except json.JSONDecodeError:
            data = raw
        event = SseEvent(id=self._id, event=self._event or "message", data=data)
        self._event, self._data = "", []
        # The id persists across frames (spec: "last event ID buffer"), so it is not reset here.
        return event


def parse_lines(lines: Iterable[str]) -> Iterator[SseEvent]:
    """Every complete event in ``lines``; a frame cut off without its blank line is dropped."""
    parser = SseParser()
    for line in lines:
        event = parser.feed(line.rstrip("\r\n"))
        if event is not None:
            yield event
