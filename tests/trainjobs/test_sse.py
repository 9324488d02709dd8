"""The SSE frame parser: what the service sends, split the ways a network splits it."""

from __future__ import annotations

from trainjobs.sse import SseEvent, SseParser, parse_lines


def test_frames_become_events_with_id_kind_and_json_data() -> None:
    lines = [
        ": keep-alive",
        "id: 7",
        "event: progress",
        'data: {"seq": 7, "step": 3}',
        "",
        "id: 8",
        "event: status",
        'data: {"seq": 8, "status": "succeeded"}',
        "",
    ]
    events = list(parse_lines(lines))
    assert events == [
        SseEvent(id="7", event="progress", data={"seq": 7, "step": 3}),
        SseEvent(id="8", event="status", data={"seq": 8, "status": "succeeded"}),
    ]
    assert [e.seq for e in events] == [7, 8]


def test_multiline_data_is_joined_and_non_json_kept_as_text() -> None:
    events = list(parse_lines(["data: first", "data: second", "", "data:{\"a\":1}", ""]))
    assert events[0].data == "first\nsecond" and events[0].event == "message"
    assert events[1].data == {"a": 1}


def test_a_frame_cut_off_before_its_blank_line_is_not_dispatched() -> None:
    # A connection dropped mid-frame: the half frame must not count, so the resume id stays correct.
    events = list(parse_lines(["id: 1", "event: metric", 'data: {"seq": 1}', "", "id: 2", "event: metric"]))
    assert [e.id for e in events] == ["1"]


def test_comment_only_frames_and_unknown_fields_are_ignored() -> None:
    parser = SseParser()
    assert parser.feed(": ping") is None
    assert parser.feed("retry: 1000") is None
    assert parser.feed("") is None
    assert parser.feed("data: {}") is None
    event = parser.feed("")
    assert event is not None and event.data == {} and event.seq is None
