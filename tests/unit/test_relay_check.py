"""The relay's typed pass against the stages over dicts: the same bytes, errors, figures and answered flag.

The reference is the pipeline as it was before the typed pass: every payload
decoded into a dict (``SseParser(typed=False)``), then ``DeltaVerifier``,
``Meter`` and ``ModelRewrite`` on each chunk. Both run through the service's
own ``_relay`` (batches, the refused-chunk rule, ``[DONE]``), driven without
an event loop.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import hypothesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capyctl.adapters.engines._sse import SseParser
from capyctl.domain.errors import EdgeError
from capyctl.domain.fields import FIELD_TABLE, DeltaVerifier, row_for
from capyctl.domain.metrics import ENGINE_OBJECTS, Meter
from capyctl.domain.relay_check import DELTA_KEYS, Choice, Head, TypedRelay, chunk_check
from capyctl.domain.requests import RequestRecord
from capyctl.domain.streams import (
    GENERATED_TEXT_KEYS,
    Chunk,
    Comment,
    Done,
    EngineFailure,
    ModelRewrite,
    Run,
    StreamEvent,
)
from capyctl.services.chat import _relay

RECORDINGS = Path(__file__).parents[1] / "contract" / "recordings"
NAME = "my-model"  # the deployment: what the client sent as model
ROWS = [("vllm", "0.32.0"), ("vllm", "0.33.0"), ("sglang", "0.5.21"), ("llamacpp", "0.6.0"), ("tensorfold", "0.6.3")]


class Ticks:
    """A clock that moves once per network read, so a per-chunk and a per-batch reading agree."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _drive(events: AsyncIterator[list[StreamEvent]]) -> tuple[list[list[StreamEvent]], BaseException | None]:
    batches: list[list[StreamEvent]] = []
    while True:
        try:
            events.__anext__().send(None)
        except StopIteration as done:
            batches.append(done.value)
        except StopAsyncIteration:
            return batches, None
        except Exception as exc:  # noqa: BLE001 - what ends the stream is what is compared
            return batches, exc


def relay(typed: bool, reads: list[bytes], family: str, version: str, max_tool_calls: int,
          runs: bool = False) -> dict[str, Any]:
    """What a client and the service see of ``reads`` relayed: bytes, the error, the meter, the record."""
    row = row_for(family, version).row
    record = RequestRecord(id="r", deployment=NAME, stream=True)
    clock = Ticks()
    meter = Meter(clock)
    stages = [DeltaVerifier(row.delta, f"{family} {version}", max_tool_calls), meter, ModelRewrite(NAME)]
    fast = TypedRelay(chunk_check(row, max_tool_calls), meter, NAME) if typed else None
    parser = SseParser(typed=typed, runs=runs)

    async def source() -> AsyncIterator[list[StreamEvent]]:  # as the wire session hands them over
        for data in reads:
            clock.now += 1
            yield list(parser.feed(data))
        if last := list(parser.close()):
            yield last

    batches, error = _drive(_relay(source(), stages, record, meter, fast, clock))
    sent = []
    for batch in batches:
        for event in batch:
            if isinstance(event, Run):  # sent on as one piece: compared chunk by chunk
                assert event.sse == b"".join(b"data: " + raw + b"\n\n" for raw in event.payloads())
                sent += [b"data: " + raw for raw in event.payloads()]
            elif isinstance(event, Chunk):
                sent.append(b"data: " + event.raw)
            elif isinstance(event, EngineFailure):
                sent.append((b"failure: " + event.raw, event.error))
            elif isinstance(event, Done):
                sent.append(b"[DONE]")
            elif isinstance(event, Comment):
                sent.append(event.raw)
        sent.append(b"-- end of batch")
    return {
        "sent": sent,
        "error": None if error is None else (type(error).__name__, str(error), getattr(error, "code", None)),
        "meter": (meter.sent_at, meter.first_text_at, meter.last_at, meter.text_chunks, meter.seen),
        "record": (record.answered, record.phase),
    }


# --- JSON text with the freedom engines have: key order, duplicates, spacing, escapes, odd numbers


class Obj:
    def __init__(self, pairs: list[tuple[str | bytes, Any]]) -> None:
        self.pairs = pairs  # a key as bytes is written as it is (an escaped key)


class RawJson:
    def __init__(self, text: bytes) -> None:
        self.text = text


def render(value: Any, space: bytes) -> bytes:
    if isinstance(value, Obj):
        items = [(k if isinstance(k, bytes) else msgspec.json.encode(k)) + b":" + space + render(v, space)
                 for k, v in value.pairs]
        return b"{" + (b"," + space).join(items) + b"}"
    if isinstance(value, list):
        return b"[" + (b"," + space).join(render(v, space) for v in value) + b"]"
    if isinstance(value, RawJson):
        return value.text
    return msgspec.json.encode(value)


def mostly(good: st.SearchStrategy[Any], odd: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``good`` seven times in eight: most chunks are valid, as on a real stream."""
    return st.integers(0, 7).flatmap(lambda i: odd if i == 0 else good)


ODD = st.sampled_from([RawJson(t) for t in (b"1e2", b"-0", b"1.0", b"1e999", b"-1e999", b"18446744073709551616",
                                            b"1" * 5000, b'"\xff"', b'"\xed\xa0\x80"', b'"caf\xc3\xa9"',
                                            b'"\\ud83d\\ude00"', b"1E-7")])
SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-3, 300), st.floats(allow_nan=False, allow_infinity=False),
                   st.text(max_size=6), st.sampled_from(["", "tiny-llama", NAME, '"model":"x"']))
ODDLY = mostly(SCALAR, ODD)  # now and then a value only a full decode refuses
INDEX = mostly(st.one_of(st.none(), st.integers(0, 3)),
               st.one_of(st.integers(-2, -1), st.sampled_from([250, 255, 256, 257, 2**64, 10**30]), st.booleans(),
                         st.sampled_from([RawJson(b"1.0"), RawJson(b"1e2"), RawJson(b"-0"), "0", 0.5])))


def nested(depth: int) -> RawJson:
    return RawJson(b"[" * depth + b"]" * depth)


def obj(fields: dict[str, st.SearchStrategy[Any]], extra: tuple[str, ...] = ()) -> st.SearchStrategy[Obj]:
    """An object with some of ``fields`` (rarely an unknown one from ``extra``, or a duplicate), in any order."""

    @st.composite
    def build(draw: st.DrawFn) -> Obj:
        names = draw(st.lists(st.sampled_from(sorted(fields)), unique=True, max_size=len(fields)))
        if extra and draw(st.integers(0, 9)) == 0:
            names.insert(draw(st.integers(0, len(names))), draw(st.sampled_from(extra)))
        pairs: list[tuple[str | bytes, Any]] = [(n, draw(fields[n] if n in fields else SCALAR)) for n in names]
        if pairs and draw(st.integers(0, 9)) == 0:  # a duplicate key: the last one counts
            name = draw(st.sampled_from(names))
            pairs.append((name, draw(fields[name] if name in fields else SCALAR)))
        return Obj(pairs)

    return build()


TEXT = mostly(st.one_of(st.text(max_size=4), st.just(""), st.none()),
              st.one_of(SCALAR, st.lists(SCALAR, max_size=2), st.just(Obj([("a", "b")]))))
FUNCTION = obj({"name": st.text(max_size=3), "arguments": st.text(max_size=3)})
TOOL_CALL = mostly(
    st.one_of(obj({"index": INDEX, "id": st.text(max_size=3), "type": st.just("function"), "function": FUNCTION},
                  extra=("extra",)),
              st.builds(lambda i, f: Obj([("index", i), ("function", f)]), INDEX, FUNCTION)),
    SCALAR)
TOOL_CALLS = mostly(st.one_of(st.none(), st.lists(TOOL_CALL, max_size=3)), SCALAR)
TOOL_DELTA = st.builds(lambda calls: Obj([("tool_calls", calls)]), st.lists(TOOL_CALL, min_size=1, max_size=3))
DELTA_FIELDS = {"role": mostly(st.sampled_from(["assistant", None]), SCALAR), "content": TEXT, "tool_calls": TOOL_CALLS}
DELTA = mostly(
    st.one_of(obj({**DELTA_FIELDS, "reasoning": TEXT},
                  extra=("foo", "hidden_states", "citations", "reasoning_content")),
              obj({**DELTA_FIELDS, "reasoning_content": TEXT}, extra=("foo", "hidden_states", "reasoning")),
              st.just(Obj([("content", "hi")])),
              TOOL_DELTA),
    st.one_of(st.none(), SCALAR))
CHOICE = mostly(
    obj({"index": INDEX, "delta": DELTA, "finish_reason": st.sampled_from([None, "stop", "length"]),
         "logprobs": st.one_of(st.none(), st.just(Obj([("content", [])])), ODDLY),
         "token_ids": st.one_of(st.none(), st.lists(st.integers(0, 9), max_size=2)),
         "matched_stop": mostly(st.none(), SCALAR)}, extra=("extra",)),
    SCALAR)
FIGURES = mostly(st.one_of(st.none(), obj({"prompt_tokens": st.integers(0, 9), "completion_tokens": SCALAR,
                                           "ttft_ms": ODDLY, "prompt_ms": SCALAR})), SCALAR)
MODEL = mostly(st.sampled_from(["tiny-llama", "qwen3-4b", NAME, "", "\u00e9\u20ac"]),
               st.one_of(st.none(), SCALAR, st.just(Obj([("a", 1)])), st.just([1])))
CHUNK_FIELDS = {"id": st.just("chatcmpl-1"), "object": st.just("chat.completion.chunk"),
                "created": mostly(st.just(1796045145), ODDLY), "model": MODEL,
                "choices": mostly(st.lists(CHOICE, min_size=1, max_size=2),
                                  st.one_of(st.just([]), st.none(), SCALAR, st.just(Obj([])))),
                "usage": FIGURES, "metrics": FIGURES, "timings": FIGURES, "tensorfold": FIGURES,
                "system_fingerprint": mostly(st.text(max_size=3), ODDLY)}
CHUNK = obj(CHUNK_FIELDS, extra=("foo", "nested", "error"))
FAILURE = obj({"error": st.one_of(obj({"message": SCALAR, "code": SCALAR}), SCALAR), "model": MODEL},
              extra=("choices", "foo"))


@st.composite
def payload(draw: st.DrawFn) -> bytes:
    kind = draw(st.integers(0, 29))
    if kind == 0:  # not a JSON object, or not JSON
        return draw(st.sampled_from([b"[1]", b"3", b'"x"', b"null", b"{", b'{"model":"x",}', b"{}x", b"\xff",
                                     b'{"choices":[{"delta":{"content":"a"}}]', b"", b"  "]))
    if kind == 1:  # nested deeper than either decoder goes, in a field the relay reads or one it does not
        where = draw(st.sampled_from([b"usage", b"foo", b"id"]))
        return b'{"' + where + b'":' + render(nested(draw(st.sampled_from([10, 900, 5000]))), b"") + b"}"
    if kind < 6:  # a tool-call chunk, its indexes near the limit
        choice = Obj([("index", 0), ("delta", draw(TOOL_DELTA))])
        return render(Obj([("model", "tiny-llama"), ("choices", [choice])]), b"")
    value = draw(FAILURE if kind == 6 else CHUNK)
    if kind == 7:  # the model key escaped, or spaced: found by neither splice, re-encoded
        value.pairs.insert(0, (draw(st.sampled_from([b'"mod\\u0065l"', b'"model" '])), "tiny-llama"))
    if kind == 8:  # the model pattern appears first inside another field
        value.pairs.insert(0, ("logprobs", Obj([("model", "tiny-llama")])))
        value.pairs.append(("model", "tiny-llama"))
    return render(value, draw(st.sampled_from([b"", b"", b"", b" "])))


@st.composite
def stream(draw: st.DrawFn) -> list[bytes]:
    """An engine stream's bytes as network reads: events, cut into reads anywhere."""
    events = []
    for data in draw(st.lists(payload(), min_size=1, max_size=8)):
        events.append(b"data: " + data + b"\n\n")
        if draw(st.integers(0, 9)) == 0:
            events.append(b": keep-alive\n\n")
    if draw(st.integers(0, 4)):
        events.append(b"data: [DONE]\n\n")
    whole = b"".join(events)
    cuts = sorted(draw(st.lists(st.integers(0, len(whole)), max_size=4)))
    if draw(st.booleans()):  # most often an engine's read holds whole events
        ends = [i + 2 for i in range(len(whole)) if whole[i:i + 2] == b"\n\n"]
        cuts = sorted(draw(st.lists(st.sampled_from(ends), max_size=4))) if ends else cuts
    return [whole[a:b] for a, b in zip([0, *cuts], [*cuts, len(whole)]) if a < b]


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(reads=stream(), row=st.sampled_from(ROWS), max_tool_calls=st.sampled_from([2, 256]))
def test_the_typed_pass_relays_exactly_what_the_stages_relay(reads: list[bytes], row: tuple[str, str],
                                                             max_tool_calls: int) -> None:
    family, version = row
    typed, reference = relay(True, reads, family, version, max_tool_calls), relay(False, reads, family, version,
                                                                                    max_tool_calls)
    hypothesis.event(f"ends with {reference['error'][1][-70:] if reference['error'] else 'no error'}")
    hypothesis.event(f"relays {min(sum(1 for s in reference['sent'] if s[:6] == b'data: '), 3)}+ chunks")
    assert typed == reference


@pytest.mark.parametrize("path", sorted(RECORDINGS.glob("*/*/*.sse")), ids=lambda p: str(p.relative_to(RECORDINGS)))
def test_every_recording_relays_the_same_and_its_valid_chunks_take_the_typed_pass(path: Path) -> None:
    family, version = path.parent.parent.name, path.parent.name
    data = path.read_bytes()
    reads = [data[i:i + 512] for i in range(0, len(data), 512)]
    assert relay(True, reads, family, version, 256) == relay(False, reads, family, version, 256)
    assert relay(True, [data], family, version, 256) == relay(False, [data], family, version, 256)
    row = row_for(family, version).row
    stages = [DeltaVerifier(row.delta, "here"), Meter(lambda: 0.0), ModelRewrite(NAME)]
    typed = TypedRelay(chunk_check(row), Meter(lambda: 0.0), NAME)
    for event in SseParser().feed(data):
        if not isinstance(event, Chunk):
            continue
        try:
            for stage in stages:
                stage(Chunk(event.raw))
        except Exception:  # noqa: BLE001 - a chunk the stages refuse (the adversarial recordings)
            continue
        assert event.head is not None and typed(event, 0.0), event.raw  # the common case: the fast path


def test_a_refusal_still_relays_the_chunks_before_it_in_the_batch_and_marks_the_answer() -> None:
    good = b'data: {"model":"tiny-llama","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
    bad = b'data: {"model":"tiny-llama","choices":[{"index":0,"delta":{"reasoning_content":"x"}}]}\n\n'
    out = relay(True, [good + bad], "vllm", "0.32.0", 256)
    assert out["sent"] == [good.replace(b"tiny-llama", NAME.encode()).rstrip(b"\n"), b"-- end of batch"]
    assert out["error"][0] == "UnverifiedStream" and "'reasoning_content'" in out["error"][1]
    assert out["record"][0] is True and out["meter"][3] == 1


def test_a_tool_call_index_at_the_limit_is_left_to_the_verifier() -> None:
    chunk = b'{"model":"m","choices":[{"index":0,"delta":{"tool_calls":[{"index":2}]}}]}'
    events = list(SseParser().feed(b"data: " + chunk + b"\n\n"))
    row = row_for("vllm", "0.32.0").row
    assert not TypedRelay(chunk_check(row, 2), Meter(lambda: 0.0), NAME)(events[0], 0.0)
    assert TypedRelay(chunk_check(row, 3), Meter(lambda: 0.0), NAME)(events[0], 0.0)
    assert relay(True, [b"data: " + chunk + b"\n\n"], "vllm", "0.32.0", 2)["error"][1].endswith(
        "past the limit of 2 tool calls")


def test_an_unusually_spaced_model_is_re_encoded_by_the_stages() -> None:
    data = b'data: {"model" : "x", "choices": []}\n\ndata: [DONE]\n\n'
    out = relay(True, [data], "vllm", "0.32.0", 256)
    assert out["sent"][0] == b'data: {"model":"my-model","choices":[]}'


def test_the_structs_know_every_key_the_field_table_and_the_meter_name() -> None:
    fields = set(Head.__struct_fields__)
    assert ENGINE_OBJECTS <= fields and {"model", "choices", "error"} <= fields
    assert set().union(*(row.delta for row in FIELD_TABLE)) | set(GENERATED_TEXT_KEYS) <= set(DELTA_KEYS)
    for row in FIELD_TABLE:  # the fields each row relays are decoded by the typed pass, not sent to the dict one
        assert set(row.relayed) <= fields | set(Choice.__struct_fields__), row.label


def test_a_chunk_built_with_a_dict_keeps_it_and_a_parsed_one_decodes_its_dict_when_read() -> None:
    given_dict = {"choices": []}
    assert Chunk(b"{}", given_dict).obj is given_dict
    parsed = list(SseParser().feed(b'data: {"model":"m","choices":[],"x":1}\n\n'))[0]
    assert parsed.head is None and parsed.obj == {"model": "m", "choices": [], "x": 1}  # unknown field: a dict
    parsed = list(SseParser().feed(b'data: {"model":"m","choices":[]}\n\n'))[0]
    assert parsed.head is not None and parsed.decoded is None
    assert parsed.obj == {"model": "m", "choices": []}


# --- runs: the plain events of one read, checked and sent on as one piece -------------------------------


@settings(max_examples=800, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(reads=stream(), row=st.sampled_from(ROWS), max_tool_calls=st.sampled_from([2, 256]))
def test_runs_relay_exactly_what_the_stages_relay(reads: list[bytes], row: tuple[str, str], max_tool_calls: int) -> None:
    family, version = row
    assert relay(True, reads, family, version, max_tool_calls, runs=True) == relay(False, reads, family, version,
                                                                                 max_tool_calls)


@pytest.mark.parametrize("path", sorted(RECORDINGS.glob("*/*/*.sse")), ids=lambda p: str(p.relative_to(RECORDINGS)))
def test_every_recording_relays_the_same_as_runs(path: Path) -> None:
    family, version = path.parent.parent.name, path.parent.name
    data = path.read_bytes()
    for reads in ([data[i:i + 512] for i in range(0, len(data), 512)], [data]):
        assert relay(True, reads, family, version, 256, runs=True) == relay(False, reads, family, version, 256)


def test_a_plain_stream_read_whole_is_one_run_then_done_and_passes_whole() -> None:
    data = (RECORDINGS / "vllm" / "0.32.0" / "chat_stream_usage.sse").read_bytes()
    events = list(SseParser(runs=True).feed(data))
    assert [type(e) for e in events] == [Run, Done]
    run = events[0]
    assert isinstance(run, Run) and len(run.heads) == data.count(b"data: {") and run.sse + b"data: [DONE]\n\n" == data
    meter = Meter(lambda: 0.0)
    assert TypedRelay(chunk_check(row_for("vllm", "0.32.0").row), meter, NAME).run(run, lambda: 5.0)
    assert run.sse.count(b'"model":"my-model"') == len(run.heads) and b"tiny-llama" not in run.sse
    assert meter.first_text_at == 5.0 and meter.text_chunks > 100 and "usage" in meter.seen


def test_what_is_not_plain_is_read_event_by_event() -> None:
    chunk = b'data: {"model":"m","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
    for odd in (b": keep-alive\n\n", b"data:{}\n\n", b'data: {"a":\n', b"data: \n\n", b"\n",
                b'data: {"error":{"message":"x"}}\n\n', b'data: {"model":"m"},{"x":1}\n\n'):
        events: list[StreamEvent] = []
        try:
            events += SseParser(runs=True).feed(chunk + odd + chunk)
        except EdgeError:  # what the event-by-event reading refuses (a payload that is no JSON object)
            pass
        assert events and not any(isinstance(e, Run) for e in events), odd


def test_a_run_the_typed_pass_declines_is_relayed_chunk_by_chunk() -> None:
    good = b'data: {"model":"tiny-llama","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
    bad = b'data: {"model":"tiny-llama","choices":[{"index":0,"delta":{"reasoning_content":"x"}}]}\n\n'
    assert isinstance(next(iter(SseParser(runs=True).feed(good + bad))), Run)
    out = relay(True, [good + bad], "vllm", "0.32.0", 256, runs=True)
    assert out == relay(False, [good + bad], "vllm", "0.32.0", 256)
    assert out["sent"][0].startswith(b'data: {"model":"my-model"') and out["error"][2] == "unverified_stream"


def test_a_run_splices_only_each_chunks_first_model_as_the_stages_do() -> None:
    twice = (b'data: {"choices":[{"index":0,"delta":{"content":"a"},"logprobs":{"model":"tiny-llama"}}],'
             b'"model":"tiny-llama"}\n\n')
    plain = b'data: {"model":"tiny-llama","choices":[{"index":0,"delta":{"content":"b"}}]}\n\n'
    data = plain + twice + plain + b"data: [DONE]\n\n"
    assert isinstance(next(iter(SseParser(runs=True).feed(data))), Run)
    out = relay(True, [data], "vllm", "0.32.0", 256, runs=True)
    assert out == relay(False, [data], "vllm", "0.32.0", 256)
    assert out["sent"][1].count(b"tiny-llama") == 1  # the first one (in logprobs) was the one spliced


def test_a_run_whose_chunks_share_their_start_is_rewritten_whole_as_the_stages_would() -> None:
    start = b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"tiny-llama",'
    data = b"".join(start + b'"choices":[{"index":0,"delta":{"content":"%d"}}]}\n\n' % i for i in range(5))
    run = next(iter(SseParser(runs=True).feed(data)))
    assert isinstance(run, Run)
    relay_ = TypedRelay(chunk_check(row_for("vllm", "0.32.0").row), Meter(lambda: 0.0), NAME)
    assert relay_._rewrite_alike(run, "tiny-llama") == data.replace(b'"model":"tiny-llama"', b'"model":"my-model"')
    assert relay(True, [data], "vllm", "0.32.0", 256, runs=True) == relay(False, [data], "vllm", "0.32.0", 256)


def test_a_shared_start_is_only_trusted_when_every_chunk_begins_with_it() -> None:
    start = b'data: {"id":"c1","model":"tiny-llama",'
    tail = b'"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
    # the second chunk spells its model escaped (the stages re-encode it) and quotes the others' start in a
    # string, where it cannot be the same bytes: one chunk without the start, and the run is spliced chunk by chunk
    odd = (b'data: {"id":"c1","model":"tiny-\\u006clama","choices":[{"index":0,"delta":{"content":'
           b'"data: {\\"id\\":\\"c1\\",\\"model\\":\\"tiny-llama\\","}}]}\n\n')
    twice = start + b'"choices":[{"index":0,"delta":{"content":"b"},"logprobs":{"model":"tiny-llama"}}]}\n\n'
    # as many models as chunks, one chunk without it; every chunk with its start, one with a second model
    for data in (start + tail + odd + start + tail, start + tail + odd, twice + odd + start + tail,
                 start + tail + twice + start + tail):
        run = next(iter(SseParser(runs=True).feed(data)))
        assert isinstance(run, Run)
        relay_ = TypedRelay(chunk_check(row_for("vllm", "0.32.0").row), Meter(lambda: 0.0), NAME)
        assert relay_._rewrite_alike(run, "tiny-llama") is None
        assert relay(True, [data], "vllm", "0.32.0", 256, runs=True) == relay(False, [data], "vllm", "0.32.0", 256)
    model_first = b'data: {"model":"tiny-llama",' + tail
    run = next(iter(SseParser(runs=True).feed(model_first * 3)))
    assert TypedRelay(chunk_check(row_for("vllm", "0.32.0").row), Meter(lambda: 0.0), NAME)._rewrite_alike(
        run, "tiny-llama") == (model_first * 3).replace(b"tiny-llama", b"my-model")


def test_streams_of_one_name_share_what_they_learn_and_not_their_figures() -> None:
    """What a TypedRelay keeps of its check and name is made once and shared by every stream of them: a model
    name the engine sent, learnt by one stream, is spliced the same by the next; more names than are kept
    (64) are still each spliced right; each stream's meter counts only its own chunks."""
    reads = [b"".join(b'data: {"model":"engine-%d","choices":[{"index":0,"delta":{"content":"t"}}]}\n\n' % i
                      for i in range(start, start + 50)) for start in (0, 50, 100)]
    for many in (reads, [b"".join(reads)]):
        first = relay(True, many, "vllm", "0.32.0", 256, runs=True)
        assert first == relay(False, many, "vllm", "0.32.0", 256)
        assert first == relay(True, many, "vllm", "0.32.0", 256, runs=True)  # a second stream, its own meter
        assert first["meter"][3] == 150 and all(b"engine-" not in sent for sent in first["sent"])
