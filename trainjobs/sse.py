"""Server-Sent Events as trainjobs reads them: httpx-sse parses the stream, this module decodes the data.

httpx-sse applies the WHATWG event-stream rules (``id`` kept across frames, ``event`` names, multi-line
``data`` joined with newlines, comment lines such as the service's ``: ping`` keep-alives ignored, a
frame cut off before its blank line never dispatched). The client, the tests and the benches all read
streams through :func:`iter_events`, so there is one parser.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
from httpx_sse import EventSource, ServerSentEvent


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


def _decoded(sse: ServerSentEvent) -> SseEvent:
    """httpx-sse's event with its data decoded: JSON when it is JSON, else the text as sent."""
    try:
        data: Any = json.loads(sse.data)
    except json.JSONDecodeError:
        data = sse.data
    return SseEvent(id=sse.id or None, event=sse.event, data=data)


def iter_events(response: httpx.Response) -> Iterator[SseEvent]:
    """Every complete event of an open ``text/event-stream`` response, as it arrives.

    A wrong content type raises ``httpx_sse.SSEError`` (an ``httpx.TransportError``). Frames without
    ``data`` are skipped: once an id was seen, httpx-sse dispatches one for every blank line (a
    keep-alive's), where the WHATWG rules dispatch nothing.
    """
    for sse in EventSource(response).iter_sse():
        if sse.data:
            yield _decoded(sse)
