"""The engine SSE parser: identical events whatever the chunk boundaries."""

from pathlib import Path

import pytest

from capyctl.adapters.engines._sse import MANY, SseParser
from capyctl.domain.errors import EdgeError
from capyctl.domain.streams import Chunk, Comment, Done, EngineFailure

RECORDINGS = Path(__file__).parents[1] / "contract" / "recordings" / "llamacpp" / "0.6.0"


def parse(data: bytes, size: int) -> list:
    parser = SseParser()
    events = []
    for start in range(0, len(data), size):
        events.extend(parser.feed(data[start : start + size]))
    events.extend(parser.close())
    return events


@pytest.mark.parametrize("size", [1, 7, 10**9])
def test_real_llama_stream_parses_the_same_at_any_boundary(size: int) -> None:
    data = (RECORDINGS / "chat_stream_usage.sse").read_bytes()
    events = parse(data, size)
    assert isinstance(events[-1], Done)
    chunks = [e for e in events if isinstance(e, Chunk)]
    assert len(chunks) == data.count(b"data: {")
    assert chunks[0].obj["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert chunks[-1].obj["usage"]["completion_tokens"] == 200
    # raw bytes are exactly the engine's payloads
    assert b"".join(b"data: " + c.raw + b"\n\n" for c in chunks) + b"data: [DONE]\n\n" == data


def test_split_utf8_and_crlf() -> None:
    data = 'data: {"choices":[{"index":0,"delta":{"content":"h\u00e9\u20ac"}}]}\r\n\r\ndata: [DONE]\r\n\r\n'.encode()
    for size in (1, 2, 3):
        events = parse(data, size)
        assert [type(e) for e in events] == [Chunk, Done]
        assert events[0].obj["choices"][0]["delta"]["content"] == "h\u00e9\u20ac"


def test_comments_errors_and_multiline_data() -> None:
    data = b': ping\n\ndata: {"error":{"code":500,"message":"boom"}}\n\ndata: {"a":\ndata: 1}\n\n'
    events = parse(data, 5)
    assert isinstance(events[0], Comment) and events[0].raw == b": ping"
    assert isinstance(events[1], EngineFailure) and events[1].error["message"] == "boom"
    assert isinstance(events[2], Chunk) and events[2].obj == {"a": 1}


def test_last_event_without_blank_line_is_flushed() -> None:
    events = parse(b'data: {"error":{"message":"x"}}\n', 4)
    assert len(events) == 1 and isinstance(events[0], EngineFailure)


def test_not_json_is_an_edge_error() -> None:
    with pytest.raises(EdgeError):
        parse(b"data: {nope\n\n", 100)


def test_events_split_at_every_seam_parse_the_same() -> None:
    data = b'data: {"a":1}\n\n: keep\n\ndata: {"b":\ndata: 2}\n\ndata: [DONE]\n\n'
    whole = parse(data, 10**9)
    for size in range(1, len(data)):
        assert parse(data, size) == whole, size
    assert [type(e) for e in whole] == [Chunk, Comment, Chunk, Done]


def test_an_event_past_the_limit_is_refused_whatever_the_reads() -> None:
    head = b'data: {"choices":[{"index":0,"delta":{"content":"'
    for piece in (64 * 1024, 1000, 1 << 20):
        parser = SseParser(max_event=256 * 1024)
        fed = 0
        with pytest.raises(EdgeError, match="larger than the limit of 262144 bytes"):
            list(parser.feed(head))
            while fed < 4 * 1024 * 1024:  # an event that never ends: refused long before this
                list(parser.feed(b"a" * piece))
                fed += piece
        assert fed <= 256 * 1024 + piece  # refused as soon as the limit was passed, not at the end


def test_an_event_just_under_the_limit_is_relayed() -> None:
    body = b'{"x":"' + b"a" * 1000 + b'"}'
    parser = SseParser(max_event=len(b"data: " + body))
    events = [e for piece in (b"data: " + body[:500], body[500:], b"\n\n") for e in parser.feed(piece)]
    assert len(events) == 1 and isinstance(events[0], Chunk) and events[0].raw == body


def test_deep_nesting_from_the_engine_is_an_edge_error() -> None:
    with pytest.raises(EdgeError, match="nested too deeply"):
        parse(b'data: {"a":' + b"[" * 100_000 + b"]" * 100_000 + b"}\n\n", 10**9)


ONE_EVENT_READS = [
    b'data: {"choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n',
    b": keep-alive\n\n",
    b"data: [DONE]\n\n",
    b'data: {"error":{"code":500,"message":"boom"}}\n\n',
    b"\n\n",  # an empty block: nothing
    b"event: ping\n\n",  # a block with no data: nothing
]


@pytest.mark.parametrize("read", ONE_EVENT_READS)
def test_a_read_of_one_whole_event_is_parsed_at_once_as_feed_parses_it(read: bytes) -> None:
    at_once, fed = SseParser(), SseParser()
    from_feed = list(fed.feed(read))
    assert len(from_feed) <= 1
    assert at_once.lone(read) == (from_feed[0] if from_feed else None)
    after = b'data: {"b":2}\n\ndata: {"c"'  # and both parsers read on alike
    assert list(at_once.feed(after)) == list(fed.feed(after))
    assert list(at_once.feed(b":3}\n\n")) == list(fed.feed(b":3}\n\n"))


@pytest.mark.parametrize("before, read", [
    (b"", b'data: {"a":1}\n\ndata: {"b":2}\n\n'),  # two events
    (b"", b'data: {"a":1}\n\ndata: {"b"'),  # an event and the start of the next
    (b"", b'data: {"a":1}'),  # an event's start
    (b"", b'data: {"a":1}\r\n\r\n'),  # CRLF line ends: normalised by feed
    (b"", b'data: {"a":\ndata: 1}\n\n'),  # one event on two data lines
    (b"", b'\ndata: {"a":1}\n\n'),  # a stray LF before it
    (b"", b'data: {"a":1}\n\n\n'),  # a stray LF after it
    (b"", b"\n"),
    (b"", b""),
    (b'data: {"a"', b':1}\n\n'),  # the end of an event under way
    (b'data: {"a":1}\r', b'\n\r\n'),  # a CR held back from the last read
])
def test_any_other_read_is_left_to_feed_untouched(before: bytes, read: bytes) -> None:
    parser, reference = SseParser(), SseParser()
    assert list(parser.feed(before)) == list(reference.feed(before))
    assert parser.lone(read) is MANY
    assert list(parser.feed(read)) == list(reference.feed(read))


def test_one_event_past_the_limit_is_refused_at_once_as_feed_refuses_it() -> None:
    read = b'data: {"x":"' + b"a" * 300 + b'"}\n\n'
    with pytest.raises(EdgeError, match="larger than the limit of 100 bytes"):
        SseParser(max_event=100).lone(read)
    with pytest.raises(EdgeError, match="larger than the limit of 100 bytes"):
        list(SseParser(max_event=100).feed(read))
    assert isinstance(SseParser(max_event=len(read) - 2).lone(read), Chunk)  # at the limit: relayed


_A = b'data: {"id":"c1","model":"m","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
_B = b'data: {"id":"c1","model":"m","choices":[{"index":0,"delta":{"content":"b"}}]}\n\n'
RUN_READS = [_A + _B, _A + _B + _A + b"data: [DONE]\n\n"]


@pytest.mark.parametrize("read", RUN_READS)
def test_a_read_of_whole_plain_events_is_one_run_at_once_as_feed_gives_it(read: bytes) -> None:
    at_once, fed = SseParser(runs=True), SseParser(runs=True)
    from_feed = list(fed.feed(read))
    got = at_once.runs(read)
    assert got is not MANY and [type(e).__name__ for e in got][:1] == ["Run"]  # type: ignore[union-attr]
    assert [type(e) for e in got] == [type(e) for e in from_feed]  # type: ignore[union-attr]
    assert [getattr(e, "sse", None) for e in got] == [getattr(e, "sse", None) for e in from_feed]  # type: ignore[union-attr]
    after = b'data: {"b":2}\n\ndata: {"c"'  # and both parsers read on alike
    assert list(at_once.feed(after)) == list(fed.feed(after))


@pytest.mark.parametrize("before, read", [
    (b"", b'data: {"a":1}\n\n'),  # one event: lone's
    (b"", b'data: {"a":1}\n\ndata: {"b"'),  # the start of the next
    (b"", b'data: {"a":1}\r\n\r\ndata: {"b":2}\r\n\r\n'),  # CRLF line ends
    (b"", b'data: {"a":1}\n\n: keep-alive\n\ndata: {"b":2}\n\n'),  # a comment among them: not plain
    (b"", b'data: {"a":1}\n\ndata: {"error":{"code":500,"message":"x"}}\n\n'),  # the engine's failure
    (b'data: {"a"', b':1}\n\ndata: {"b":2}\n\n'),  # an event under way
    (b"", _A + b"data: [DONE]\n\n"),  # one event and [DONE]: a Chunk, not a run
])
def test_any_other_read_is_left_to_feed_by_runs(before: bytes, read: bytes) -> None:
    parser, reference = SseParser(runs=True), SseParser(runs=True)
    assert list(parser.feed(before)) == list(reference.feed(before))
    assert parser.runs(read) is MANY
    assert list(parser.feed(read)) == list(reference.feed(read))
    assert SseParser(runs=False).runs(RUN_READS[0]) is MANY  # a parser that makes no runs makes none here
