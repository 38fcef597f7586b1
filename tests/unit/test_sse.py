"""The engine SSE parser: identical events whatever the chunk boundaries."""

from pathlib import Path

import pytest

from capyctl.adapters.engines._sse import SseParser
from capyctl.domain.errors import BadEngineResponse
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


def test_not_json_is_a_bad_engine_response() -> None:
    with pytest.raises(BadEngineResponse):
        parse(b"data: {nope\n\n", 100)
