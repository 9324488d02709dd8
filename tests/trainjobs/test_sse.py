"""Reading the service's event streams: httpx-sse's parsing as the client sees it, split the ways a
network splits it, and the client's resumption with ``Last-Event-ID`` across cut connections."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from tests.api.live import serve
from trainjobs.client import Client
from trainjobs.sse import SseEvent, iter_events

WIRE = (
    b": ping\n\n"
    b'id: 7\nevent: progress\ndata: {"seq": 7, "step": 3}\n\n'
    b": ping\n\n"  # a keep-alive after an id: httpx-sse dispatches an empty frame, iter_events drops it
    b'id: 8\r\nevent: status\r\ndata: {"seq": 8,\r\ndata:  "status": "succeeded"}\r\n\r\n'
)


def response(chunks: list[bytes], content_type: str = "text/event-stream") -> httpx.Response:
    """An httpx response whose body arrives in ``chunks``, as a socket would deliver it."""
    return httpx.Response(200, headers={"content-type": content_type}, content=iter(chunks))


def test_frames_become_events_with_id_kind_and_json_data_however_the_bytes_are_split() -> None:
    expected = [
        SseEvent(id="7", event="progress", data={"seq": 7, "step": 3}),
        SseEvent(id="8", event="status", data={"seq": 8, "status": "succeeded"}),
    ]
    for size in (1, 2, 5, len(WIRE)):  # CRLF split between its CR and LF, fields split mid-name
        chunks = [WIRE[i : i + size] for i in range(0, len(WIRE), size)]
        events = list(iter_events(response(chunks)))
        assert events == expected, size
        assert [e.seq for e in events] == [7, 8]


def test_multiline_data_is_joined_and_non_json_kept_as_text() -> None:
    events = list(iter_events(response([b'data: first\ndata: second\n\ndata:{"a":1}\n\n'])))
    assert events[0] == SseEvent(id=None, event="message", data="first\nsecond")
    assert events[1].data == {"a": 1} and events[1].seq is None


def test_a_frame_cut_off_before_its_blank_line_is_not_dispatched() -> None:
    # A connection dropped mid-frame: the half frame must not count, so the resume id stays correct.
    wire = [b'id: 1\nevent: metric\ndata: {"seq": 1}\n\nid: 2\nevent: metric\ndata: {"seq": 2}']
    assert [e.id for e in iter_events(response(wire))] == ["1"]


def test_a_body_that_is_not_an_event_stream_is_a_transport_error() -> None:
    # The client's reconnect loop treats it as a drop (httpx_sse.SSEError is an httpx.TransportError).
    with pytest.raises(httpx.TransportError, match="text/event-stream"):
        list(iter_events(response([b"<html>proxy error</html>"], "text/html")))


LOG = "step 1 loé 0.5\nstep 2 done\n".encode()  # "é" is bytes 9 and 10: a connection ends between them


def frame(seq: int, kind: str, data: str) -> str:
    return f"id: {seq}\nevent: {kind}\ndata: {data}\n\n"


@pytest.fixture
def cutting_api() -> Iterator[tuple[str, list[str | None]]]:
    """A stand-in for the events route that cuts every connection after two events and half a third:
    the first cleanly (the stream just ends), the next ones abruptly (no end of the chunked body).
    It honours ``Last-Event-ID`` as the real route does; yields its URL and the ids it was asked for."""
    asked: list[str | None] = []
    events = [frame(seq, "metric", f'{{"seq": {seq}}}') for seq in range(1, 6)]
    events.append(frame(6, "status", '{"seq": 6, "status": "succeeded"}'))

    async def route(request: Request) -> StreamingResponse:
        last = request.headers.get("last-event-id")
        asked.append(last)
        rest = events[int(last or 0) :]

        async def body() -> AsyncIterator[str]:
            yield ": ping\n\n"
            for text in rest[:2]:
                yield text
            if len(rest) > 2:
                yield rest[2][: len(rest[2]) // 2]
                if len(asked) > 1:
                    raise ConnectionAbortedError("cut")  # uvicorn drops the connection mid-body

        return StreamingResponse(body(), media_type="text/event-stream")

    async def log(request: Request) -> StreamingResponse:
        # The run's log from the byte offset asked for, five bytes a connection; every other one cut.
        offset = int(request.query_params["offset"])
        asked.append(str(offset))
        sent[0] = offset + 5

        async def body() -> AsyncIterator[bytes]:
            yield LOG[offset : offset + 5]
            if len(asked) % 2 == 0 and sent[0] < len(LOG):
                raise ConnectionAbortedError("cut")

        return StreamingResponse(body(), media_type="text/plain")

    async def job(request: Request) -> JSONResponse:
        return JSONResponse({"status": "succeeded" if sent[0] >= len(LOG) else "running"})

    sent = [0]
    routes = [Route("/v1/jobs/{job_id}/events", route), Route("/v1/jobs/{job_id}/logs", log),
              Route("/v1/jobs/{job_id}", job)]  # fmt: skip
    with serve(Starlette(routes=routes)) as url:  # type: ignore[arg-type]
        yield url, asked


def test_events_resume_after_each_cut_with_the_last_id_and_nothing_twice(
    cutting_api: tuple[str, list[str | None]],
) -> None:
    url, asked = cutting_api
    with Client(url, "key", retry_max_s=10) as client:
        events = list(client.events("job"))
    assert [e.seq for e in events] == [1, 2, 3, 4, 5, 6]
    assert events[-1].data["status"] == "succeeded"
    # Each reconnection asked for what follows the last whole event (never the half one).
    assert asked == [None, "2", "4"]


def test_the_log_follow_resumes_at_its_byte_offset_through_the_same_loop(
    cutting_api: tuple[str, list[str | None]],
) -> None:
    url, asked = cutting_api
    with Client(url, "key", retry_max_s=10) as client:
        text = "".join(client.follow_log("job"))
    assert text == LOG.decode()  # the "é" cut between two connections is whole, nothing repeats
    assert asked == [str(n) for n in range(0, len(LOG), 5)]
