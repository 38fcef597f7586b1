"""The relay's one check (``relay_check.StreamCheck``) against its reference written over dicts (``tests/oracle``).

A stream's bytes, cut into network reads, go through the engine adapter's
``SseParser`` and then the check, both ways the product has: over the C
scan's facts (``"c"``, where ``_speedups.scan`` was built) and over msgspec's
typed decode (``"python"``, ``SseParser(scan=False)``, the way of a build
without a C compiler); and over the facts of the C scan's Python reference
(``"reference"``, ``_speedups.scan_reference``, run everywhere). Each must
send the same bytes, end on the same error,
keep the same engine error event and leave the meter with the same figures
as ``OracleCheck`` over the same reads, but where the check reads a chunk
otherwise by design (``read_unlike_the_oracle``: then the two ways are held
to each other). The faults these tests found and src/ still has are strict
xfails at the end.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import hypothesis
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capyctl._speedups import scan_reference
from capyctl.adapters.engines._sse import SseParser
from capyctl.domain.errors import CapyError, EdgeError
from capyctl.domain.fields import FIELD_TABLE, row_for
from capyctl.domain.metrics import ENGINE_OBJECTS, Meter
from capyctl.domain.relay_check import (
    DELTA_KEYS,
    OBJECT_NAMES,
    Choice,
    ChunkRules,
    Delta,
    Head,
    Refused,
    StreamCheck,
    ToolCall,
)
from capyctl.domain.streams import Chunks, Comment, Done
from tests.oracle import TEXT_KEYS, OracleCheck

try:
    from capyctl._speedups import scan as _scan
except ImportError:  # a build without a C compiler: the Python way is still tested below
    _scan = None

RECORDINGS = Path(__file__).parents[1] / "contract" / "recordings"
NAME = "my-model"  # the deployment: what the client sent as model
ROWS = [("vllm", "0.32.0"), ("vllm", "0.33.0"), ("sglang", "0.5.21"), ("llamacpp", "0.6.0"), ("tensorfold", "0.6.3")]
NO_SCAN = "the C scan was not built (no C compiler): its way is not there to test"
WAYS = ["python", "reference", pytest.param("c", marks=pytest.mark.skipif(_scan is None, reason=NO_SCAN))]
SCAN_OF = {"python": False, "reference": scan_reference, "c": True}  # SseParser's scan for each way
MANY_EXAMPLES = settings(
    max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)


class Ticks:
    """A clock that moves once per network read (so a check that reads it once a read and one that reads it
    once a chunk note the same times), counting how often it is read."""

    def __init__(self) -> None:
        self.now = 100.0
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now


def told(error: CapyError) -> tuple[str, str, Any]:
    """What a client is told of an error: its type and code, and its words where they are the verifier's (the
    wording of a payload that is no JSON object is msgspec's, and is not compared)."""
    reason = error.extra.get("reason", "") if isinstance(error, EdgeError) else ""
    return type(error).__name__, error.code, None if reason.startswith("the engine sent") else str(error)


def relay(
    way: str, reads: list[bytes], family: str, version: str, max_tool_calls: int = 256, name: str = NAME
) -> dict[str, Any]:
    """What a client and the meter see of ``reads`` relayed ``way``: the bytes sent per read, the error that
    ended the stream, the engine's error event, the meter's figures."""
    row = row_for(family, version).row
    where = f"{family} {version}"
    clock = Ticks()
    meter = Meter(clock)
    checker: OracleCheck | StreamCheck
    if way == "oracle":
        checker = oracle = OracleCheck(row, where, name, max_tool_calls)

        def check(chunks: Chunks) -> bytes:
            return oracle.check(chunks.payload_list(), meter, clock.now)
    else:
        checker = StreamCheck(ChunkRules(row, where, max_tool_calls), meter, name, clock)
        check = checker.check
    parser = SseParser(scan=SCAN_OF.get(way, False))
    sent: list[bytes] = []
    error = None
    for data in [*reads, None]:
        clock.now += 1
        parts: list[bytes] = []
        for event in parser.feed(data) if data is not None else parser.close():
            if isinstance(event, Chunks):
                try:
                    parts.append(check(event))
                except Refused as refused:
                    parts.append(refused.sent)
                    error = told(refused.error)
                    break
            elif isinstance(event, Comment):
                parts.append(event.raw + b"\n\n")
            else:
                assert isinstance(event, Done)
                parts.append(b"data: [DONE]\n\n")
        if data is not None or parts:  # (what close() gives: a last event not ended by a blank line)
            sent.append(b"".join(parts))
        if error is not None:
            break
    return {
        "sent": sent,
        "error": error,
        "failure": checker.failure,
        "meter": (meter.first_text_at, meter.last_at, meter.text_chunks, meter.seen),
    }


# --- JSON text with the freedom engines have: key order, duplicates, spacing, escapes, odd numbers ----------


class Obj:
    def __init__(self, pairs: list[tuple[str | bytes, Any]]) -> None:
        self.pairs = pairs  # a key as bytes is written as it is (an escaped key)


class RawJson:
    def __init__(self, text: bytes) -> None:
        self.text = text


def render(value: Any, space: bytes) -> bytes:
    if isinstance(value, Obj):
        items = [
            (k if isinstance(k, bytes) else msgspec.json.encode(k)) + b":" + space + render(v, space)
            for k, v in value.pairs
        ]
        return b"{" + (b"," + space).join(items) + b"}"
    if isinstance(value, list):
        return b"[" + (b"," + space).join(render(v, space) for v in value) + b"]"
    if isinstance(value, RawJson):
        return value.text
    return msgspec.json.encode(value)


def mostly(good: st.SearchStrategy[Any], odd: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """``good`` seven times in eight: most chunks are valid, as on a real stream."""
    return st.integers(0, 7).flatmap(lambda i: odd if i == 0 else good)


ODD = st.sampled_from(
    [
        RawJson(t)
        for t in (
            b"1e2",
            b"-0",
            b"1.0",
            b"1e999",
            b"-1e999",
            b"18446744073709551616",
            b"1" * 5000,
            b'"\xff"',
            b'"\xed\xa0\x80"',
            b'"caf\xc3\xa9"',
            b'"\\ud83d\\ude00"',
            b'"\\udc00"',
            b"1E-7",
            b"NaN",
        )
    ]
)
SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-3, 300),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=6),
    st.sampled_from(["", "tiny-llama", NAME, '"model":"x"']),
)
ODDLY = mostly(SCALAR, ODD)  # now and then a value only a full decode refuses
HUGE = [10**18 - 1, 10**18, 10**19 - 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30, 10**40]  # 18 digits and more
INDEX = mostly(
    st.one_of(st.none(), st.integers(0, 3)),
    st.one_of(
        st.integers(-2, -1),
        st.sampled_from([250, 255, 256, 257, *HUGE]),
        st.booleans(),
        st.sampled_from(
            [RawJson(b"1.0"), RawJson(b"1e2"), RawJson(b"-0"), RawJson(b"00"), RawJson(b"-" + b"9" * 19), "0", 0.5]
        ),
    ),
)


def nested(depth: int) -> RawJson:
    return RawJson(b"[" * depth + b"]" * depth)


def obj(fields: dict[str, st.SearchStrategy[Any]], extra: tuple[str, ...] = ()) -> st.SearchStrategy[Obj]:
    """An object with some of ``fields`` (rarely an unknown one from ``extra``, or a duplicate), in any order."""

    @st.composite
    def build(draw: st.DrawFn) -> Obj:
        names = draw(st.lists(st.sampled_from(sorted(fields)), unique=True, max_size=len(fields)))
        if extra and draw(st.integers(0, 9)) == 0:
            names.insert(draw(st.integers(0, len(names))), draw(st.sampled_from(extra)))
        pairs: list[tuple[str | bytes, Any]] = [(n, draw(fields.get(n, SCALAR))) for n in names]
        if pairs and draw(st.integers(0, 9)) == 0:  # a duplicate key: the last one counts
            name = draw(st.sampled_from(names))
            pairs.append((name, draw(fields.get(name, SCALAR))))
        return Obj(pairs)

    return build()


TEXT = mostly(
    st.one_of(st.text(max_size=4), st.just(""), st.none()),
    st.one_of(SCALAR, st.lists(SCALAR, max_size=2), st.just(Obj([("a", "b")])), st.just(Obj([]))),
)
FUNCTION = obj({"name": st.text(max_size=3), "arguments": st.text(max_size=3)})
TOOL_CALL = mostly(
    st.one_of(
        obj(
            {"index": INDEX, "id": st.text(max_size=3), "type": st.just("function"), "function": FUNCTION},
            extra=("extra", "model"),
        ),
        st.builds(lambda i, f: Obj([("index", i), ("function", f)]), INDEX, FUNCTION),
    ),
    SCALAR,
)
TOOL_CALLS = mostly(st.one_of(st.none(), st.lists(TOOL_CALL, max_size=3)), SCALAR)
TOOL_DELTA = st.builds(lambda calls: Obj([("tool_calls", calls)]), st.lists(TOOL_CALL, min_size=1, max_size=3))
DELTA_FIELDS = {"role": mostly(st.sampled_from(["assistant", None]), SCALAR), "content": TEXT, "tool_calls": TOOL_CALLS}
DELTA = mostly(
    st.one_of(
        obj(
            {**DELTA_FIELDS, "reasoning": TEXT},  # vLLM's keys; now and then one a row refuses or none knows
            extra=("foo", "hidden_states", "citations", "reasoning_content", "model"),
        ),
        obj({**DELTA_FIELDS, "reasoning_content": TEXT}, extra=("foo", "hidden_states", "reasoning")),
        st.just(Obj([("content", "hi")])),
        TOOL_DELTA,
    ),
    st.one_of(st.none(), SCALAR),
)
CHOICE = mostly(
    obj(
        {
            "index": INDEX,
            "delta": DELTA,
            "finish_reason": st.sampled_from([None, "stop", "length"]),
            "logprobs": st.one_of(
                st.none(), st.just(Obj([("content", [])])), st.just(Obj([("model", "tiny-llama")])), ODDLY
            ),
            "token_ids": st.one_of(st.none(), st.lists(st.integers(0, 9), max_size=2)),
            "matched_stop": mostly(st.none(), SCALAR),
        },
        extra=("extra", "model"),
    ),
    SCALAR,
)
FIGURES = mostly(
    st.one_of(
        st.none(),
        obj(
            {
                "prompt_tokens": st.integers(0, 9),
                "completion_tokens": SCALAR,
                "ttft_ms": ODDLY,
                "prompt_ms": SCALAR,
                "model": SCALAR,
            }
        ),
    ),
    SCALAR,
)
MODEL = mostly(
    st.sampled_from(["tiny-llama", "qwen3-4b", NAME, "", "\u00e9\u20ac", 'a"b', "a\\b", "\u2028"]),
    st.one_of(
        st.none(),
        SCALAR,
        st.just(Obj([("a", 1)])),
        st.just(Obj([("model", "x")])),
        st.just([1]),
        st.sampled_from(
            [
                RawJson(b'"tiny-\\u006clama"'),
                RawJson(b'"my-\\u006dodel"'),
                RawJson(b'"tiny-llama\\/"'),
                RawJson(b"1.00"),
                RawJson(b"1E2"),
            ]
        ),
    ),
)
CHUNK_FIELDS = {
    "id": st.just("chatcmpl-1"),
    "object": st.just("chat.completion.chunk"),
    "created": mostly(st.just(1796045145), ODDLY),
    "model": MODEL,
    "choices": mostly(
        st.lists(CHOICE, min_size=1, max_size=2), st.one_of(st.just([]), st.none(), SCALAR, st.just(Obj([])))
    ),
    "usage": FIGURES,
    "metrics": FIGURES,
    "timings": FIGURES,
    "tensorfold": FIGURES,
    "system_fingerprint": mostly(st.text(max_size=3), ODDLY),
}
CHUNK = obj(CHUNK_FIELDS, extra=("foo", "nested", "error", "xmodel", "model_"))
FAILURE = obj(
    {"error": st.one_of(obj({"message": SCALAR, "code": SCALAR}), SCALAR), "model": MODEL},
    extra=("choices", "foo", "usage"),
)


@st.composite
def payload(draw: st.DrawFn) -> bytes:
    """One chunk's payload: most often a chunk as engines send them, now and then one of their failures."""
    kind = draw(st.integers(0, 29))
    if kind == 0:  # not a JSON object, or not JSON, or blank
        return draw(
            st.sampled_from(
                [
                    b"[1]",
                    b"3",
                    b'"x"',
                    b"null",
                    b"{",
                    b'{"model":"x",}',
                    b"{}x",
                    b"\xff",
                    b'{"choices":[{"delta":{"content":"a"}}]',
                    b"",
                    b"  ",
                    b"{}",
                    b"{} ",
                ]
            )
        )
    if kind == 1:  # nested deeper than either decoder goes, in a field the relay reads or one it does not
        where = draw(st.sampled_from([b"usage", b"foo", b"id", b"model", b"error"]))
        return b'{"' + where + b'":' + render(nested(draw(st.sampled_from([10, 60, 70, 900, 5000]))), b"") + b"}"
    if kind < 6:  # a tool-call chunk, its indexes near the limit
        choice = Obj([("index", 0), ("delta", draw(TOOL_DELTA))])
        return render(Obj([("model", "tiny-llama"), ("choices", [choice])]), b"")
    value = draw(FAILURE if kind == 6 else CHUNK)
    if kind == 7:  # the model key escaped, or spaced: found by no splice, written anew
        value.pairs.insert(0, (draw(st.sampled_from([b'"mod\\u0065l"', b'"model" ', b' "model"'])), "tiny-llama"))
    if kind == 8:  # the model pattern appears first inside another field
        value.pairs.insert(0, (draw(st.sampled_from(["logprobs", "usage", "foo"])), Obj([("model", "tiny-llama")])))
        value.pairs.append(("model", "tiny-llama"))
    text = render(value, draw(st.sampled_from([b"", b"", b"", b" ", b"\t"])))
    if kind == 9 and b',"' in text:  # a payload on two data: lines (JSON whitespace between them)
        text = text.replace(b',"', b',\n"', 1)
    return text


ANY_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)  # any character but a lone surrogate
VALUE = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(10**20), 10**20)
    | st.floats(allow_nan=False, allow_infinity=False)
    | ANY_TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(ANY_TEXT, inner, max_size=3),
    max_leaves=6,
)
DELTA_VALUE = st.one_of(ANY_TEXT, st.none(), VALUE)
PLAIN_INDEX = mostly(st.one_of(st.integers(0, 300), st.none()), st.sampled_from(HUGE))
PLAIN_TOOL_CALL = st.fixed_dictionaries(
    {"index": PLAIN_INDEX}, optional={"id": ANY_TEXT, "type": st.just("function"), "function": VALUE}
)
PLAIN_DELTA = st.fixed_dictionaries(
    {},
    optional={
        "role": st.sampled_from(["assistant", None]),
        "content": DELTA_VALUE,
        "reasoning": DELTA_VALUE,
        "reasoning_content": DELTA_VALUE,
        "tool_calls": st.one_of(st.none(), st.lists(PLAIN_TOOL_CALL, max_size=3)),
    },
)
PLAIN_CHOICE = st.fixed_dictionaries(
    {"index": st.integers(0, 3), "delta": st.one_of(PLAIN_DELTA, st.none())},
    optional={"logprobs": VALUE, "finish_reason": st.sampled_from([None, "stop"]), "token_ids": VALUE},
)
PLAIN_OBJECT = st.one_of(
    st.none(), st.dictionaries(st.sampled_from(["prompt_tokens", "completion_tokens"]), st.integers(0, 99))
)


@st.composite
def plain_chunks(draw: st.DrawFn) -> list[bytes]:
    """Chunks as engines send them, all valid JSON, most often with one model: what the C scan should take."""
    model = draw(st.sampled_from(["tiny-llama", NAME, "caf\u00e9", "\u00e9\u20ac", "m"]))
    chunks = []
    for _ in range(draw(st.integers(1, 6))):
        chunk: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1796045145}
        sent = draw(st.sampled_from([model] * 18 + ["absent", "other", 1, None]))
        if sent != "absent":
            chunk["model"] = sent
        chunk["choices"] = draw(st.one_of(st.lists(PLAIN_CHOICE, max_size=2), st.none()))
        for name in draw(
            st.lists(st.sampled_from([*OBJECT_NAMES, "error", "system_fingerprint"]), unique=True, max_size=2)
        ):
            chunk[name] = draw(PLAIN_OBJECT)
        chunks.append(msgspec.json.encode(chunk))
    return chunks


@st.composite
def stream(draw: st.DrawFn) -> list[bytes]:
    """An engine stream's bytes as network reads: events, cut into reads anywhere."""
    events = []
    for data in draw(st.one_of(st.lists(payload(), min_size=1, max_size=8), plain_chunks())):
        events.append(b"".join(b"data: " + line + b"\n" for line in data.split(b"\n")) + b"\n")
        if draw(st.integers(0, 19)) == 0:
            events.append(b": keep-alive\n\n")
    if draw(st.integers(0, 4)):
        events.append(b"data: [DONE]\n\n")
    whole = b"".join(events)
    if draw(st.integers(0, 9)) == 0:
        whole = whole.replace(b"\n", b"\r\n")
    cuts = sorted(draw(st.lists(st.integers(0, len(whole)), max_size=4)))
    if draw(st.integers(0, 2)):  # most often an engine's read holds whole events: the scan's reads
        ends = [i + 2 for i in range(len(whole)) if whole[i : i + 2] == b"\n\n"]
        cuts = sorted(draw(st.lists(st.sampled_from(ends), max_size=4))) if ends else cuts
    return [whole[a:b] for a, b in zip([0, *cuts], [*cuts, len(whole)], strict=False) if a < b]


@pytest.mark.parametrize("way", WAYS)
@MANY_EXAMPLES
@given(
    reads=stream(),
    row=st.sampled_from(ROWS),
    max_tool_calls=st.sampled_from([2, 256]),
    name=st.sampled_from([NAME, "tiny-llama"]),
)
def test_the_check_relays_exactly_what_the_oracle_relays(
    way: str, reads: list[bytes], row: tuple[str, str], max_tool_calls: int, name: str
) -> None:
    out = relay(way, reads, *row, max_tool_calls, name)
    hypothesis.event(f"ends with {out['error'][0] if out['error'] else 'no error'}")
    if way != "python":
        parser = SseParser(scan=SCAN_OF[way])
        scanned = sum(1 for read in reads for e in parser.feed(read) if isinstance(e, Chunks) and e.facts is not None)
        hypothesis.event(f"the {way} scan read {min(scanned, 2)}+ reads")
    hypothesis.event(f"relays {min(sum(s.count(b'data: {') for s in out['sent']), 3)}+ chunks")
    unlike = read_unlike_the_oracle(reads)
    if unlike:  # held to the other way only (see read_unlike_the_oracle)
        hypothesis.event(f"a chunk {unlike}")
        assert out == relay(
            "python" if way != "python" else "c" if _scan is not None else "reference",
            reads,
            *row,
            max_tool_calls,
            name,
        )
    else:
        assert out == relay("oracle", reads, *row, max_tool_calls, name)


READ_KEYS = frozenset({"model", "choices", "error", "index", "delta", *DELTA_KEYS})
_decode_head = msgspec.json.Decoder(Head).decode


def read_unlike_the_oracle(reads: list[bytes]) -> str | None:
    """Why the check reads a chunk of ``reads`` otherwise than the oracle does, by design or as a known fault;
    None for most streams. The check decodes the fields it reads and skips the rest as msgspec skips a
    field it does not know: it takes a chunk whose unread fields hold what only a full decode refuses
    (a number out of range; invalid UTF-8 it refuses as the oracle does); and where the oracle (a dict)
    keeps the last value of a repeated key alone, the check reads every value, refusing one of the wrong
    type, a key the row refuses or a tool call past the limit."""
    repeated = False

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal repeated
        keys = [key for key, _ in items]
        repeated = repeated or any(keys.count(key) > 1 for key in READ_KEYS.intersection(keys))
        return dict(items)

    parser = SseParser(scan=False)
    for event in [*parser.feed(b"".join(reads)), *parser.close()]:
        for payload in event.payload_list() if isinstance(event, Chunks) else ():
            with contextlib.suppress(ValueError, RecursionError):
                json.loads(payload, object_pairs_hook=pairs)
            if repeated:
                return "repeats a key the check reads"
            try:
                msgspec.json.decode(payload)
            except (msgspec.DecodeError, RecursionError):
                try:
                    payload.decode()
                    _decode_head(payload)
                except (msgspec.DecodeError, RecursionError, UnicodeDecodeError):
                    continue
                return "holds in an unread field what only a full decode refuses"
    return None


def per_event(data: bytes) -> list[bytes]:
    """``data`` a read per event, as an engine streaming at its pace sends it."""
    reads, start = [], 0
    while (end := data.find(b"\n\n", start)) != -1:
        reads.append(data[start : end + 2])
        start = end + 2
    return reads + [data[start:]] if start < len(data) else reads


def recordings() -> list[Any]:
    return [pytest.param(path, id=str(path.relative_to(RECORDINGS))) for path in sorted(RECORDINGS.glob("*/*/*.sse"))]


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("path", recordings())
def test_every_recording_relays_as_the_oracle_relays_it(path: Path, way: str) -> None:
    family, version = path.parent.parent.name, path.parent.name
    data = path.read_bytes()
    for reads in ([data[i : i + 512] for i in range(0, len(data), 512)], [data], per_event(data)):
        assert relay(way, reads, family, version) == relay("oracle", reads, family, version)


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("path", [p for p in recordings() if not p.values[0].name.startswith("adv_")])
def test_a_plain_recording_read_whole_is_checked_once_not_chunk_by_chunk(path: Path, way: str) -> None:
    """The common case takes the one typed check of a read: the clock is read at most twice for all its chunks
    (a check chunk by chunk reads it once each); over the scan's facts, the payloads are not even split."""
    family, version = path.parent.parent.name, path.parent.name
    data = path.read_bytes().replace(b"\r\n", b"\n")
    chunks = [e for e in SseParser(scan=SCAN_OF[way]).feed(data) if isinstance(e, Chunks)]
    assert len(chunks) == 1 and (chunks[0].facts is not None) == (way != "python")
    clock = Ticks()
    meter = Meter(clock)
    clock.reads = 0
    sent = StreamCheck(ChunkRules(row_for(family, version).row, "here"), meter, NAME, clock).check(chunks[0])
    assert clock.reads <= 2 and sent.count(b'"model":"my-model"') == data.count(b'"model":') > 1
    assert meter.text_chunks > 0 and meter.first_text_at == meter.last_at == clock.now
    if way != "python":
        assert chunks[0].payloads is None  # respelt at the scan's positions


@pytest.mark.parametrize("way", WAYS)
def test_a_refusal_still_relays_the_chunks_before_it_in_the_read_and_meters_them(way: str) -> None:
    good = b'data: {"model":"tiny-llama","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
    bad = b'data: {"model":"tiny-llama","choices":[{"index":0,"delta":{"reasoning_content":"x"}}]}\n\n'
    out = relay(way, [good + bad + good], "vllm", "0.32.0")
    assert out == relay("oracle", [good + bad + good], "vllm", "0.32.0")
    assert out["sent"] == [good.replace(b"tiny-llama", NAME.encode())]
    assert out["error"][:2] == ("UnverifiedStream", "unverified_stream") and "'reasoning_content'" in out["error"][2]
    assert out["meter"][2] == 1
    assert relay(way, [good + bad + good], "sglang", "0.5.21")["error"] is None  # a key SGLang's row allows
    vllm_key = bad.replace(b"reasoning_content", b"reasoning")  # and one it refuses
    assert "'reasoning'" in relay(way, [good + vllm_key], "sglang", "0.5.21")["error"][2]


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("index", [2, 3, 255, 256, 10**18 - 1, 10**18, 2**63, 2**64, 10**40])
def test_a_tool_call_index_at_or_past_the_limit_ends_the_stream_with_the_verifiers_reason(way: str, index: int) -> None:
    chunk = b'data: {"model":"m","choices":[{"index":0,"delta":{"tool_calls":[{"index":%d}]}}]}\n\n' % index
    lead = b'data: {"model":"m","choices":[{"index":0,"delta":{"tool_calls":[{"index":1}]}}]}\n\n'
    for limit in (2, 3, 256):
        out = relay(way, [lead + chunk], "vllm", "0.32.0", limit)
        assert out == relay("oracle", [lead + chunk], "vllm", "0.32.0", limit)
        if index < limit:
            assert out["error"] is None and out["meter"][2] == 2
        else:
            assert out["error"][1] == "edge_error" and out["error"][2].endswith(
                f"a tool call's 'index' is {index}, past the limit of {limit} tool calls"
            )
            assert out["sent"] == [lead.replace(b'"m"', b'"my-model"')]


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("index", [0, 7, 10**18 - 1, 10**18, 2**63, 2**64, 10**40])
def test_a_choice_index_of_any_size_is_relayed_untouched(way: str, index: int) -> None:
    chunk = b'data: {"model":"m","choices":[{"index":%d,"delta":{"content":"a"}}]}\n\n' % index
    out = relay(way, [chunk * 2], "vllm", "0.32.0")
    assert out == relay("oracle", [chunk * 2], "vllm", "0.32.0")
    assert out["error"] is None and out["sent"] == [chunk.replace(b'"m"', b'"my-model"') * 2]


@pytest.mark.parametrize("way", WAYS)
def test_an_unusually_spaced_or_escaped_model_is_written_anew(way: str) -> None:
    for data, sent in (
        (b'{"model" : "x", "choices": []}', b'{"model":"my-model","choices":[]}'),
        (b'{"model":"\\u0078","choices":[]}', b'{"model":"my-model","choices":[]}'),
        (b'{"mod\\u0065l":"x","id":"a"}', b'{"model":"my-model","id":"a"}'),
        (b'{"model":"x","model":"y"}', b'{"model":"x","model":"my-model"}'),  # the last one counts
        (b'{"model":"my-model","model":"y"}', b'{"model":"my-model","model":"my-model"}'),
        (b'{"model": "x"}', b'{"model":"my-model"}'),
    ):
        read = b"data: " + data + b"\n\n"
        out = relay(way, [read, read + read], "vllm", "0.32.0")
        assert out == relay("oracle", [read, read + read], "vllm", "0.32.0")
        assert out["sent"] == [b"data: " + sent + b"\n\n", (b"data: " + sent + b"\n\n") * 2], data


@pytest.mark.parametrize("way", WAYS)
def test_only_each_chunks_first_model_pattern_is_renamed(way: str) -> None:
    plain = b'data: {"model":"tiny-llama","choices":[{"index":0,"delta":{"content":"b"}}]}\n\n'
    for twice in (
        b'data: {"choices":[{"index":0,"delta":{"content":"a"},"logprobs":{"model":"tiny-llama"}}],'
        b'"model":"tiny-llama"}\n\n',
        b'data: {"choices":[{"index":0,"model":"tiny-llama","delta":{"content":"a"}}],"model":"tiny-llama"}\n\n',
        b'data: {"choices":[{"index":0,"delta":{"tool_calls":[{"model":"tiny-llama","index":0}]}}],'
        b'"model":"tiny-llama"}\n\n',
    ):
        data = plain + twice + plain + b"data: [DONE]\n\n"
        out = relay(way, [data], "vllm", "0.32.0")
        assert out == relay("oracle", [data], "vllm", "0.32.0")
        assert out["sent"][0].count(b"tiny-llama") == 1 and out["sent"][0].index(b"tiny-llama") > len(plain)
        assert out["sent"][0].count(b'"model":"my-model"') == 3  # the nested one, first, was the one spliced


@pytest.mark.parametrize("way", WAYS)
def test_the_engines_error_event_is_relayed_untouched_and_kept(way: str) -> None:
    good = b'data: {"model":"tiny-llama","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
    for event, failure in (
        (b'{"error":{"message":"boom","code":500},"model":"tiny-llama"}', {"message": "boom", "code": 500}),
        (b'{"error":"out of memory"}', {"message": "out of memory"}),
        (b'{"error":null,"usage":{"prompt_tokens":3}}', {"message": "None"}),
    ):
        read = good + b"data: " + event + b"\n\n" + good
        out = relay(way, [read], "vllm", "0.32.0")
        assert out == relay("oracle", [read], "vllm", "0.32.0")
        renamed = good.replace(b"tiny-llama", NAME.encode())
        assert out["sent"] == [renamed + b"data: " + event + b"\n\n" + renamed]
        assert out["failure"] == failure and out["meter"][2] == 2 and out["meter"][3] == {}
    with_choices = b'data: {"error":"x","choices":[],"model":"tiny-llama"}\n\n'  # no failure: a chunk
    out = relay(way, [with_choices], "vllm", "0.32.0")
    assert out["failure"] is None and out["sent"] == [with_choices.replace(b"tiny-llama", NAME.encode())]


@pytest.mark.parametrize("way", WAYS)
def test_the_meter_keeps_the_last_engine_object_of_each_name_and_counts_text(way: str) -> None:
    chunks = [
        b'{"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}',
        b'{"model":"m","choices":[{"index":0,"delta":{"reasoning":"r"}}],"metrics":{"a":1}}',
        b'{"model":"m","choices":[{"index":0,"delta":{"tool_calls":[]}}],"usage":{"n":1}}',
        b'{"model":"m","choices":[{"index":0,"delta":{"content":"c"}}],"usage":{"n":2},"metrics":null}',
        b'{"model":"m","choices":[],"timings":{},"tensorfold":[0]}',
    ]
    data = b"".join(b"data: " + c + b"\n\n" for c in chunks)
    for reads in ([data], [b"data: " + c + b"\n\n" for c in chunks]):
        out = relay(way, reads, "vllm", "0.32.0")
        assert out == relay("oracle", reads, "vllm", "0.32.0")
        first_text = 101.0 if len(reads) == 1 else 102.0
        assert out["meter"] == (
            first_text,
            100.0 + len(reads),
            2,
            {"metrics": {"a": 1}, "usage": {"n": 2}, "timings": {}, "tensorfold": [0]},
        )


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("text_at", [None, 0, 2, 4])
def test_the_clock_is_read_once_a_read_and_once_more_after_the_first_text(way: str, text_at: int | None) -> None:
    """The meter's times: the first text at the read's first reading, the last chunk at a later one where
    chunks came after the first text in the read."""
    chunks = [
        b'{"model":"m","choices":[{"index":0,"delta":{"content":"%b"}}]}' % (b"t" if i == text_at else b"")
        for i in range(5)
    ]
    (event,) = SseParser(scan=SCAN_OF[way]).feed(b"".join(b"data: " + c + b"\n\n" for c in chunks))
    readings = iter([1.0, 2.0, 3.0])
    meter = Meter(lambda: 0.0)
    StreamCheck(ChunkRules(row_for("vllm", "0.32.0").row, "here"), meter, NAME, lambda: next(readings)).check(event)
    expected = {None: (None, 1.0, 0), 0: (1.0, 2.0, 1), 2: (1.0, 2.0, 1), 4: (1.0, 1.0, 1)}[text_at]
    assert (meter.first_text_at, meter.last_at, meter.text_chunks) == expected


@pytest.mark.parametrize("way", WAYS)
def test_streams_of_many_engine_model_names_are_each_renamed(way: str) -> None:
    reads = [
        b"".join(
            b'data: {"model":"engine-%d","choices":[{"index":0,"delta":{"content":"t"}}]}\n\n' % i
            for i in range(start, start + 50)
        )
        for start in (0, 50, 100)
    ]
    for many in (reads, [b"".join(reads)]):
        first = relay(way, many, "vllm", "0.32.0")
        assert first == relay("oracle", many, "vllm", "0.32.0")
        assert first == relay(way, many, "vllm", "0.32.0")  # a second stream, its own meter
        assert first["meter"][2] == 150 and all(b"engine-" not in sent for sent in first["sent"])


@pytest.mark.parametrize("way", WAYS)
def test_a_payload_on_several_lines_is_checked_as_its_json(way: str) -> None:
    good = b'data: {"model":"x","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
    for lines, error in (
        (b'data: {"model":"x",\ndata: "choices":[{"index":0,"delta":{"content":"b"}}]}\n\n', None),
        (b'data: {"model":"x",\ndata: "choices":[{"delta":{"foo":1}}]}\n\n', "unverified_stream"),
        (b'data: {"model":\ndata: "x"\n\n', "edge_error"),
    ):
        out = relay(way, [good + lines + good], "vllm", "0.32.0")
        assert out == relay("oracle", [good + lines + good], "vllm", "0.32.0")
        assert (out["error"] and out["error"][1]) == error and out["meter"][2] == (3 if error is None else 1)
    for model in (b"my-model", b"x"):
        read = b'data: {"model":"%b",\ndata: "choices":[]}\n\n' % model
        (sent,) = relay(way, [read], "vllm", "0.32.0")["sent"]
        (client,) = SseParser(scan=False).feed(sent)  # how a client reads what it was sent: that payload
        assert isinstance(client, Chunks) and client.payload_list() == [b'{"model":"my-model",\n"choices":[]}']


@pytest.mark.parametrize("way", WAYS)
def test_a_blank_or_non_object_payload_is_an_edge_error_after_the_chunks_before_it(way: str) -> None:
    good = b'data: {"model":"my-model","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
    for bad in (
        b"data: \n\n",
        b"data:  \n\n",
        b"data: [1]\n\n",
        b"data: {}x\n\n",
        b'data: "x"\n\n',
        b'data: {"usage":' + b"[" * 5000 + b"]" * 5000 + b"}\n\n",
    ):
        out = relay(way, [good + bad + good], "vllm", "0.32.0")
        assert out == relay("oracle", [good + bad + good], "vllm", "0.32.0")
        assert out["sent"] == [good] and out["error"][1] == "edge_error", bad


@pytest.mark.parametrize("way", WAYS)
def test_a_model_to_write_anew_in_a_chunk_with_no_dict_is_an_edge_error_after_the_chunks_before_it(way: str) -> None:
    """The typed decode skips an unread field it would refuse to decode (a number out of range, invalid UTF-8);
    a chunk whose model must be written anew from its dict then has none: refused, not a crash."""
    good = b'data: {"model":"x","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
    for odd in (
        b'{"model" :"x","created":1e999}',
        b'{"mod\\u0065l":"x","id":"\xff"}',
        b'{"model":"\\u0078","n":1e400}',
    ):
        for reads in ([good + b"data: " + odd + b"\n\n" + good], [good, b"data: " + odd + b"\n\n"]):
            out = relay(way, reads, "vllm", "0.32.0")
            assert out == relay("oracle", reads, "vllm", "0.32.0")
            assert out["sent"][-1] == (good.replace(b'"x"', b'"my-model"') if len(reads) == 1 else b"")
            assert out["error"][1] == "edge_error" and out["meter"][2] == 1, odd


def test_a_chunks_given_its_payloads_or_not_is_checked_the_same() -> None:
    data = (RECORDINGS / "vllm" / "0.32.0" / "chat_stream_usage.sse").read_bytes()
    body = data[: -len(b"data: [DONE]\n\n")]
    outcomes = []
    for chunks in (Chunks(body), Chunks(body, body[6:-2].split(b"\n\ndata: "))):
        meter = Meter(lambda: 0.0)
        sent = StreamCheck(ChunkRules(row_for("vllm", "0.32.0").row, "here"), meter, NAME, lambda: 1.0).check(chunks)
        outcomes.append((sent, meter.text_chunks, meter.seen))
    assert outcomes[0] == outcomes[1] and outcomes[0][0] == body.replace(b'"model":"tiny-llama"', b'"model":"my-model"')


def test_a_read_whose_chunks_share_their_start_is_renamed_whole_only_when_each_begins_with_it() -> None:
    check = StreamCheck(ChunkRules(row_for("vllm", "0.32.0").row, "here"), Meter(lambda: 0.0), NAME, lambda: 0.0)
    pattern = b'"model":"tiny-llama"'
    start = b'data: {"id":"c1","model":"tiny-llama",'
    tail = b'"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
    alike = b"".join(start + b'"choices":[{"index":0,"delta":{"content":"%d"}}]}\n\n' % i for i in range(5))
    assert check._rename_alike(alike, pattern, 5) == alike.replace(pattern, b'"model":"my-model"')
    model_first = b'data: {"model":"tiny-llama",' + tail
    assert check._rename_alike(model_first * 3, pattern, 3) == (model_first * 3).replace(b"tiny-llama", b"my-model")
    # the second chunk spells its model escaped and quotes the others' start in a string, where it cannot be the
    # same bytes; one chunk has a second pattern: not alike, renamed chunk by chunk
    odd = (
        b'data: {"id":"c1","model":"tiny-\\u006clama","choices":[{"index":0,"delta":{"content":'
        b'"data: {\\"id\\":\\"c1\\",\\"model\\":\\"tiny-llama\\","}}]}\n\n'
    )
    twice = start + b'"choices":[{"index":0,"delta":{"content":"b"},"logprobs":{"model":"tiny-llama"}}]}\n\n'
    for data in (
        start + tail + odd + start + tail,
        start + tail + odd,
        twice + odd + start + tail,
        start + tail + twice + start + tail,
    ):
        count = data.count(b"data: {")
        assert check._rename_alike(data, pattern, count) is None
        assert relay("python", [data], "vllm", "0.32.0") == relay("oracle", [data], "vllm", "0.32.0")


def test_the_structs_know_every_key_the_field_table_and_the_meter_name() -> None:
    """The head reads model, choices, error and the meter's objects, skipping any other field unread; a delta
    is read whole, its keys every one the field table knows (any other fails the decode)."""
    assert Head.__struct_fields__ == ("model", "choices", "error", *OBJECT_NAMES)
    assert set(OBJECT_NAMES) == ENGINE_OBJECTS and list(OBJECT_NAMES) == sorted(OBJECT_NAMES)
    assert set().union(*(row.delta for row in FIELD_TABLE)) | set(TEXT_KEYS) | {"role"} == set(DELTA_KEYS)
    assert Delta.__struct_config__.forbid_unknown_fields
    for struct in (Head, Choice, ToolCall):
        assert not struct.__struct_config__.forbid_unknown_fields, struct


def test_refused_keys_are_what_each_row_leaves_out() -> None:
    """Each row's decode takes the keys the row allows and fails on every other known key; the C scan's bits
    name the same refused keys."""
    for row in FIELD_TABLE:
        rules = ChunkRules(row, "here", max_tool_calls=8)
        for i, key in enumerate(DELTA_KEYS):
            chunk = b'{"choices":[{"index":0,"delta":{"%s":null}}]}' % key.encode()
            if key in row.delta:
                assert rules.decode(chunk).choices[0].delta is not None
                assert not rules.refused_bits & 1 << i
            else:
                with pytest.raises(msgspec.ValidationError, match=key):
                    rules.decode(chunk)
                assert rules.refused_bits & 1 << i
        rules.decode(b'{"choices":[{"delta":{"tool_calls":[{"index":7}]}}]}')
        with pytest.raises(msgspec.ValidationError, match="tool_calls"):
            rules.decode(b'{"choices":[{"delta":{"tool_calls":[{"index":8}]}}]}')


# --- known faults, each to be fixed in src/ (these then pass: remove the marker) --------------------------------


@pytest.mark.parametrize("way", WAYS)
def test_invalid_utf8_in_a_field_the_check_does_not_read_is_an_edge_error(way: str) -> None:
    read = b'data: {"id":"\xff","model":"m","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
    assert relay("oracle", [read], "vllm", "0.32.0")["error"][1] == "edge_error"
    assert relay(way, [read], "vllm", "0.32.0")["error"] == relay("oracle", [read], "vllm", "0.32.0")["error"]


@pytest.mark.parametrize("way", WAYS)
def test_a_key_the_row_refuses_reaches_no_client_in_an_earlier_value_of_a_repeated_key(way: str) -> None:
    """A client that keeps the first value of a repeated key would read a delta key vLLM's row refuses."""
    for chunk in (
        b'{"choices":[{"index":0,"delta":{"reasoning_content":"x"},"delta":{"content":"a"}}]}',
        b'{"choices":[{"index":0,"delta":{"reasoning_content":"x"}}],"choices":[]}',
        b'{"choices":[{"index":0,"delta":{"tool_calls":[{"index":900,"index":0}]}}]}',
    ):
        error = relay(way, [b"data: " + chunk + b"\n\n"], "vllm", "0.32.0")["error"]
        assert error is not None and error[:2] == ("EdgeError", "edge_error"), (chunk, error)
        check = StreamCheck(ChunkRules(row_for("vllm", "0.32.0").row, "here"), Meter(Ticks()), NAME, Ticks())
        with pytest.raises(Refused, match=r"reasoning_content|\.index"):  # msgspec names what it refused
            check.check(Chunks(b"data: " + chunk + b"\n\n"))
    spaced = b'{"choices":[{"index":0,"delta":{"content":"a"}}],"id":"x","id":"y"}'  # a key the check skips
    assert relay(way, [b"data: " + spaced + b"\n\n"], "vllm", "0.32.0")["error"] is None
