"""Relay stages and the non-streamed assembler, on real llama.cpp chunks."""

from pathlib import Path

import msgspec

from capyctl.adapters.engines._sse import SseParser
from capyctl.domain.streams import Assembler, Chunk, ModelRewrite, has_generated_text

RECORDINGS = Path(__file__).parents[1] / "contract" / "recordings" / "llamacpp" / "0.6.0"


def chunks(name: str) -> list[Chunk]:
    parser = SseParser()
    return [e for e in parser.feed((RECORDINGS / name).read_bytes()) if isinstance(e, Chunk)]


def test_model_rewrite_touches_only_the_model_bytes() -> None:
    rewrite = ModelRewrite("my-model")
    for chunk in chunks("chat_stream_stop.sse"):
        before = chunk.raw
        after = rewrite(chunk)
        assert after.raw == before.replace(b'"model":"smollm2-135m-instruct"', b'"model":"my-model"')
        assert msgspec.json.decode(after.raw)["model"] == "my-model"
        assert after.obj["model"] == "my-model"


def test_model_rewrite_falls_back_to_reencoding_unusual_spacing() -> None:
    chunk = Chunk(b'{"model" : "x", "choices": []}', {"model": "x", "choices": []})
    out = ModelRewrite("y")(chunk)
    assert msgspec.json.decode(out.raw) == {"model": "y", "choices": []}


def test_model_rewrite_leaves_a_matching_name_alone() -> None:
    raw = b'{"model":"same","choices":[]}'
    assert ModelRewrite("same")(Chunk(raw, {"model": "same", "choices": []})).raw is raw


def test_role_only_chunk_is_not_generated_text() -> None:
    first, second = chunks("chat_stream_stop.sse")[:2]
    assert not has_generated_text(first.obj)
    assert has_generated_text(second.obj)


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
