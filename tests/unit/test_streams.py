"""The relay's model rewrite and text detection, and the non-streamed assembler, on real llama.cpp chunks."""

from pathlib import Path

import msgspec
import pytest

from capyctl.adapters.engines._sse import SseParser
from capyctl.domain.engines import EngineFamily as F
from capyctl.domain.fields import row_for
from capyctl.domain.metrics import Meter
from capyctl.domain.relay_check import ChunkRules, StreamCheck
from capyctl.domain.streams import Assembler, Chunks, ScanFacts, payloads_of, sse_of

RECORDINGS = Path(__file__).parents[1] / "contract" / "recordings" / "llamacpp" / "0.6.0"


class Chunk:
    """One recorded chunk: its payload bytes and its dict."""

    def __init__(self, raw: bytes) -> None:
        self.raw = raw
        self.obj = msgspec.json.decode(raw)


def chunks(name: str) -> list[Chunk]:
    events = SseParser().feed((RECORDINGS / name).read_bytes())
    return [Chunk(raw) for e in events if isinstance(e, Chunks) for raw in e.payload_list()]


def check_for(name: str) -> tuple[StreamCheck, Meter]:
    meter = Meter(lambda: 0.0)
    return StreamCheck(ChunkRules(row_for(F.LLAMACPP, "0.6.0").row, "test"), meter, name, lambda: 0.0), meter


def test_model_rewrite_touches_only_the_model_bytes() -> None:
    check, _ = check_for("my-model")
    recorded = chunks("chat_stream_stop.sse")
    for chunk in recorded:  # one chunk a read
        after = check.check(Chunks(sse_of([chunk.raw])))
        assert after == sse_of([chunk.raw.replace(b'"model":"smollm2-135m-instruct"', b'"model":"my-model"')])
        assert msgspec.json.decode(payloads_of(after)[0])["model"] == "my-model"
    whole = sse_of([chunk.raw for chunk in recorded])  # all in one read
    assert check.check(Chunks(whole)) == whole.replace(b'"model":"smollm2-135m-instruct"', b'"model":"my-model"')


def test_model_rewrite_falls_back_to_reencoding_unusual_spacing() -> None:
    check, _ = check_for("y")
    out = check.check(Chunks(sse_of([b'{"model" : "x", "choices": []}'])))
    assert [msgspec.json.decode(p) for p in payloads_of(out)] == [{"model": "y", "choices": []}]


def test_model_rewrite_leaves_a_matching_name_alone() -> None:
    check, _ = check_for("same")
    sse = sse_of([b'{"model":"same","choices":[]}', b'{"model":"same","choices":[]}'])
    assert check.check(Chunks(sse)) is sse


def test_role_only_chunk_is_not_generated_text() -> None:
    first, second = chunks("chat_stream_stop.sse")[:2]
    check, meter = check_for("m")
    check.check(Chunks(sse_of([first.raw])))
    assert meter.text_chunks == 0 and meter.first_text_at is None
    check.check(Chunks(sse_of([second.raw])))
    assert meter.text_chunks == 1 and meter.first_text_at is not None


def test_assembler_joins_real_stream_with_usage_and_timings() -> None:
    recorded = chunks("chat_stream_usage.sse")
    assembler = Assembler("my-model")
    for chunk in recorded:
        assembler.add(chunk.obj)
    answer = assembler.result()
    text = "".join(c.obj["choices"][0]["delta"].get("content") or "" for c in recorded if c.obj["choices"])
    assert answer["object"] == "chat.completion"
    assert answer["model"] == "my-model"
    assert answer["choices"] == [
        {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
    ]
    assert answer["usage"]["completion_tokens"] == 200
    assert answer["timings"]["predicted_n"] == 200
    assert answer["system_fingerprint"] == "b0-unknown"
    assert answer["id"] == recorded[0].obj["id"]


def test_assembler_joins_tool_calls_by_index_and_keeps_reasoning() -> None:
    assembler = Assembler("m")
    deltas = [
        {"role": "assistant", "content": None},
        {"reasoning_content": "think"},
        {"reasoning_content": "ing"},
        {"tool_calls": [{"index": 0, "id": "c1", "type": "function", "function": {"name": "get", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]},
        {"tool_calls": [{"index": 1, "id": "c2", "type": "function", "function": {"name": "put", "arguments": "{}"}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]},
    ]
    for delta in deltas:
        assembler.add({"choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
    assembler.add({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]})
    message = assembler.result()["choices"][0]["message"]
    assert message["content"] is None
    assert message["reasoning_content"] == "thinking"
    assert message["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"a":1}'}},
        {"id": "c2", "type": "function", "function": {"name": "put", "arguments": "{}"}},
    ]
    assert assembler.result()["choices"][0]["finish_reason"] == "tool_calls"


def test_a_payload_of_several_lines_is_relayed_as_as_many_data_lines() -> None:
    """SSE joins an event's data lines with a line feed; the relayed event must give the client the same JSON."""
    check, meter = check_for("mine")
    (event,) = SseParser().feed(b'data: {"model":"x",\ndata: "choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n')
    relayed = check.check(event)
    assert relayed.startswith(b"data: ") and all(line.startswith(b"data: ") for line in relayed.split(b"\n") if line)
    (again,) = SseParser().feed(relayed)
    assert [msgspec.json.decode(p) for p in again.payload_list()] == [
        {"model": "mine", "choices": [{"index": 0, "delta": {"content": "hi"}}]}
    ]
    assert payloads_of(relayed) == again.payload_list() and meter.text_chunks == 1


def test_the_scans_facts_are_read_by_name_and_by_position_as_the_tuple_they_replace() -> None:
    """The scan's answer (``ScanFacts``, built in C by a call of the type): named fields, in the order the C
    passes them; read by position too, as the tuple the scan answered with before; frozen."""
    facts = ScanFacts(2, b'"m"', 0b101, 7, 1, 0, (6, 20), None)
    assert ScanFacts.__struct_fields__ == (
        "count",
        "model",
        "delta_keys",
        "top_index",
        "text_count",
        "first_text",
        "objects",
        "positions",
    )
    assert (facts.count, facts.model, facts.delta_keys, facts.top_index) == (2, b'"m"', 0b101, 7)
    assert (facts.text_count, facts.first_text, facts.objects, facts.positions) == (1, 0, (6, 20), None)
    with pytest.raises(TypeError):
        facts[0]  # type: ignore[index]  # read by name only, never by position
    with pytest.raises(AttributeError):
        facts.count = 3  # frozen
    assert facts == ScanFacts(2, b'"m"', 0b101, 7, 1, 0, (6, 20), None) and hash(facts) == hash(facts)
