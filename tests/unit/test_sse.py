"""The engine SSE parser: identical events whatever the chunk boundaries."""

from pathlib import Path

import pytest

from capyctl.adapters.engines._sse import SseParser
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

