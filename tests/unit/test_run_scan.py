"""The run scan in C (``_speedups/scan.c``) against the way it replaces: msgspec's decode of the heads.

Whatever the scan accepts, the decode must accept too, and the facts it
reads must be the ones the decoded heads give; the typed pass must then do
exactly what it does over the heads. Where the scan is unsure it declines,
and the run is decoded as before, so declining is always allowed; accepting
the common case (the recordings) is asserted too, or the scan would buy
nothing.
"""

from __future__ import annotations

import array
import copy
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from unittest import mock

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msgspec import UNSET

from capyctl.adapters.engines import _sse
from capyctl.domain import relay_check
from capyctl.domain.fields import row_for
from capyctl.domain.metrics import Meter
from capyctl.domain.relay_check import DELTA_KEYS, Choice, Delta, Head, ToolCall, TypedRelay, chunk_check, scan_run
from capyctl.domain.streams import Run
from tests.unit.test_relay_check import NAME, RECORDINGS, ROWS, payload, relay, stream

# Built where a C compiler was found at install; without it, the relay decodes every run (tests/unit/
# test_relay_check.py holds that way to the stages), and test_layers checks it is built wherever gcc is.
_scan = pytest.importorskip("capyctl._speedups.scan", reason="the C run scan was not built (no C compiler)")
MAX_EVENT = _sse.DEFAULT_MAX_EVENT
SLOW = settings(max_examples=1500, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@contextmanager
def without_scan() -> Iterator[None]:
    with mock.patch.object(_sse, "scan_run", None):
        yield


def decoded_run(body: bytes) -> Run | None:
    """The run as the parser made it before the scan: its heads decoded by msgspec."""
    with without_scan():
        return _sse._run(body, MAX_EVENT)


def payload_spans(body: bytes) -> list[tuple[int, int]]:
    """Where each payload of a run begins and ends in its bytes."""
    spans, at = [], 6
    for payload in body[6:-2].split(b"\n\ndata: "):
        spans.append((at, at + len(payload)))
        at += len(payload) + 8  # its blank line and the next "data: "
    return spans


def facts_of(heads: list[Head], body: bytes) -> tuple[Any, ...]:
    """The scan's facts but the last, worked out from decoded heads the way the typed pass reads them."""
    keys, top, texts, objects = 0, -1, [], []
    for i, head in enumerate(heads):
        text = False
        for choice in head.choices or ():
            delta = choice.delta
            if delta is None:
                continue
            for bit, key in enumerate(DELTA_KEYS):
                if getattr(delta, key) is not UNSET:
                    keys |= 1 << bit
            for call in delta.tool_calls or ():
                if call.index is not None:
                    top = max(top, call.index)
            text = text or bool(delta.content or delta.reasoning_content or delta.reasoning or delta.tool_calls)
        texts.append(text)
        if relay_check._has_objects(head):
            objects += payload_spans(body)[i]
    models = {msgspec.json.encode(head.model) if head.model is not UNSET else None for head in heads}
    assert len(models) == 1  # the scan accepts only a model every chunk sends alike (or none sends)
    return (len(heads), models.pop(), keys, top, sum(texts), texts.index(True) if True in texts else -1,
            tuple(objects))


def check_positions(body: bytes, facts: tuple[Any, ...]) -> None:
    """Positions, when the scan gives them, are each chunk's model token, right after ``"model":``, the only
    occurrence of that pattern in its chunk (so respelling there is each chunk's first-occurrence splice)."""
    model, positions = facts[1], facts[7]
    if positions is None:
        return
    assert model is not None
    at = array.array("I", positions).tolist()
    spans = payload_spans(body)
    assert len(at) == len(spans), body
    for (begin, end), position in zip(spans, at):
        assert begin < position < end and body[position - 8:position + len(model)] == b'"model":' + model, body
        assert body[begin:end].count(b'"model":' + model) == 1, body


TEXT = st.text(st.characters(blacklist_categories=("Cs",)), max_size=8)  # any character but a lone surrogate
VALUE = st.recursive(
    st.none() | st.booleans() | st.integers(-10**20, 10**20) | st.floats(allow_nan=False, allow_infinity=False) | TEXT,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3), max_leaves=6)
DELTA_VALUE = st.one_of(TEXT, st.none(), VALUE)
TOOL_CALL = st.fixed_dictionaries({"index": st.one_of(st.integers(0, 300), st.none())},
                                  optional={"id": TEXT, "type": st.just("function"), "function": VALUE})
DELTA = st.fixed_dictionaries({}, optional={"role": st.sampled_from(["assistant", None]), "content": DELTA_VALUE,
                                            "reasoning": DELTA_VALUE, "reasoning_content": DELTA_VALUE,
                                            "tool_calls": st.one_of(st.none(), st.lists(TOOL_CALL, max_size=3))})
CHOICE = st.fixed_dictionaries({"index": st.integers(0, 3), "delta": st.one_of(DELTA, st.none())},
                               optional={"logprobs": VALUE, "finish_reason": st.sampled_from([None, "stop"]),
                                         "token_ids": VALUE})
OBJECTS = st.one_of(st.none(), st.dictionaries(st.sampled_from(["prompt_tokens", "completion_tokens"]),
                                                st.integers(0, 99)))


@st.composite
def plain_chunks(draw: st.DrawFn) -> list[bytes]:
    """Chunks as engines send them, all valid JSON, most often with one model: what the scan should take."""
    model = draw(st.sampled_from(["tiny-llama", NAME, "caf\u00e9", "\u00e9\u20ac", "m"]))
    chunks = []
    for _ in range(draw(st.integers(2, 6))):
        chunk: dict[str, Any] = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1796045145}
        if draw(st.integers(0, 19)):
            chunk["model"] = model if draw(st.integers(0, 19)) else draw(st.sampled_from(["other", 1, None]))
        chunk["choices"] = draw(st.one_of(st.lists(CHOICE, max_size=2), st.none()))
        for name in draw(st.lists(st.sampled_from(["usage", "metrics", "timings", "tensorfold", "error",
                                                   "system_fingerprint"]), unique=True, max_size=2)):
            chunk[name] = draw(OBJECTS)
        chunks.append(msgspec.json.encode(chunk))
    return chunks


PAYLOADS = st.one_of(plain_chunks(), st.lists(payload(), min_size=2, max_size=6))


def body_of(payloads: list[bytes]) -> bytes:
    return b"".join(b"data: " + p + b"\n\n" for p in payloads)


def check_against_decode(body: bytes) -> tuple[Any, ...] | None:
    """The scan's facts for ``body``, held to the decode's: accepted only where the decode makes a run."""
    assert scan_run is not None
    facts = scan_run(body)
    if facts is not None:
        run = decoded_run(body)
        assert run is not None, body  # the scan accepted what msgspec refuses (or a failure event)
        assert facts[:7] == facts_of(list(run.heads), body), body
        check_positions(body, facts)
    return facts


def test_the_scan_is_built() -> None:
    assert scan_run is not None, "the C run scan was not built: `pip install -e .` needs a C compiler"


def test_the_scan_knows_the_structs_field_for_field() -> None:
    """Its field lists are the structs' (a field it does not know it refuses; one it knows wrongly it would
    pass), and the structs are what it assumes of them: every field is decoded (unknown ones forbidden),
    the few it reads typed as it reads them, the rest Any."""

    assert _scan.HEAD_FIELDS == Head.__struct_fields__ and _scan.CHOICE_FIELDS == Choice.__struct_fields__
    assert _scan.DELTA_FIELDS == Delta.__struct_fields__ == DELTA_KEYS
    assert _scan.TOOL_CALL_FIELDS == ToolCall.__struct_fields__
    typed = {(Head, "choices"): "list[Choice] | None | UnsetType", (Choice, "index"): "Index | None",
             (Choice, "delta"): "Delta | None", (Delta, "tool_calls"): "list[ToolCall] | None | UnsetType",
             (ToolCall, "index"): "Index | None"}
    for struct in (Head, Choice, Delta, ToolCall):
        assert struct.__struct_config__.forbid_unknown_fields
        for name in struct.__struct_fields__:
            assert struct.__annotations__[name] == typed.get((struct, name), "Any"), (struct, name)


@pytest.mark.parametrize("path", sorted(RECORDINGS.glob("*/*/*.sse")), ids=lambda p: str(p.relative_to(RECORDINGS)))
def test_every_recorded_run_is_scanned_as_the_decode_reads_it(path: Path) -> None:
    data = path.read_bytes()
    body = data[:-14] if data.endswith(b"\n\ndata: [DONE]\n\n") else data
    facts = check_against_decode(body)
    run = decoded_run(body)
    if run is not None and not path.name.startswith("adv_"):  # a plain recorded stream: the scan takes it
        assert facts is not None, path


CASES = [
    # (payload, whether the decode takes it) - the edges of strings, numbers, nesting and the structs
    (b'{"id":"a\x7f","model":"m"}', True), (b'{"id":"a\x01","model":"m"}', False),
    (b'{"id":"caf\xc3\xa9 \xf0\x9f\x98\x80","model":"m"}', True), (b'{"id":"\xed\xa0\x80","model":"m"}', False),
    (b'{"id":"\xc0\x80","model":"m"}', False), (b'{"id":"\xf4\x90\x80\x80","model":"m"}', False),
    (b'{"id":"\xe0\x9f\xbf","model":"m"}', False), (b'{"id":"\xc3","model":"m"}', False),
    (b'{"id":"\\u00e9\\n\\t\\"\\\\\\/","model":"m"}', True), (b'{"id":"\\x","model":"m"}', False),
    (b'{"id":"\\ud83d\\ude00","model":"m"}', True), (b'{"id":"\\udc00","model":"m"}', False),
    (b'{"id":1e400,"model":"m"}', False), (b'{"id":1e99,"model":"m"}', True), (b'{"id":-0.0e-5,"model":"m"}', True),
    (b'{"id":01,"model":"m"}', False), (b'{"id":1.,"model":"m"}', False), (b'{"id":-,"model":"m"}', False),
    (b'{"id":' + b"9" * 41 + b',"model":"m"}', True), (b'{"id":tru,"model":"m"}', False),
    (b'{"model":"m","choices":[{"index":-0}]}', True), (b'{"model":"m","choices":[{"index":1.0}]}', False),
    (b'{"model":"m","choices":[{"index":' + b"9" * 19 + b"}]}", True),
    (b'{"model":"m","model":"m"}', True), (b'{"model":"m","foo":1}', False), (b'{"mod\\u0065l":"m"}', True),
    (b'{"model":"m","choices":[null]}', False), (b'{"model":"m","choices":{}}', False),
    (b'{"model":"m","choices":[{"delta":{"content":"a","x":1}}]}', False),
    (b'{"model":"m","choices":[{"delta":{"tool_calls":[{"index":3,"id":"c"}]}}]}', True),
    (b'{"model":"m","error":{"message":"x"}}', True), (b'{"model":"m","error":1,"choices":[]}', True),
    (b'{"model":"m","usage":' + b"[" * 70 + b"]" * 70 + b"}", True), (b'{"model":"m"}x', False),
    (b'{"model":"m",}', False), (b'{"model" : "m" , "choices" : [ ] }\r', True), (b"{}", True),
    (b'{"model":"m","choices":[{"delta":{"reasoning_content":"x","tool_calls":[{"index":9}]}}],"choices":[]}', True),
    (b'{"model":"m","usage":{"a":1},"usage":null}', True), (b'{"model":null}', True), (b'{"model":"m\\u0000"}', True), (b'{"model":"m","choices":[{"delta":null}]}', True),
]


@pytest.mark.parametrize("chunk, valid", CASES)
def test_the_scan_takes_no_chunk_the_decode_refuses(chunk: bytes, valid: bool) -> None:
    plain = b'{"model":"m","choices":[{"index":0,"delta":{"content":"a"}}]}'
    for payloads in ([chunk, plain], [plain, chunk]):
        with without_scan():  # the case is what it says it is: the decode's own verdict
            try:
                msgspec.json.decode(chunk, type=Head)
                decodes = True
            except (msgspec.DecodeError, RecursionError):
                decodes = False
        assert decodes == valid, chunk
        check_against_decode(body_of(payloads))


def test_the_scan_reads_what_each_delta_sends() -> None:
    chunks = [b'{"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}',
              b'{"model":"m","choices":[{"index":0,"delta":{"reasoning":0.0}},{"delta":{"content":[0]}}]}',
              b'{"model":"m","choices":[{"delta":{"tool_calls":[{"index":7},{"index":null}]}}],"usage":null}',
              b'{"model":"m","choices":[{"delta":{"reasoning_content":null,"tool_calls":[]}}],"usage":{}}']
    body = body_of(chunks)
    facts = check_against_decode(body)
    assert facts is not None and facts[:7] == (4, b'"m"', 0b11111, 7, 2, 1, payload_spans(body)[3])
    assert array.array("I", facts[7]).tolist() == [m.start() + 8 for m in re.finditer(b'"model":', body)]


def test_a_run_is_spliceable_where_its_model_pattern_is_each_chunks_model_field_alone() -> None:
    plain = b'{"model":"m","choices":[]}'
    for chunk, spliceable in ((plain, True), (b'{"choices":[],"model":"m"}', True),
                              (b'{"model" :"m","choices":[]}', False), (b'{"model": "m","choices":[]}', False),
                              (b'{"choices":[{"logprobs":{"model":"m"}}],"model":"m"}', False),
                              (b'{"choices":[{"delta":{"content":"\\"model\\":\\"m\\""}}],"model":"m"}', True),
                              (b'{"usage":{"x":[{"model":1}]},"model":"m"}', False)):
        facts = check_against_decode(body_of([plain, chunk]))
        assert facts is not None and (facts[7] is not None) is spliceable, chunk


def test_respell_writes_the_new_token_only_where_the_old_one_is() -> None:
    body = body_of([b'{"model":"ab","choices":[]}', b'{"choices":[],"model":"ab"}'])
    facts = scan_run(body)
    assert facts is not None and facts[7] is not None
    assert _scan.respell(body, facts[7], b'"ab"', b'"my-model"') == body.replace(b'"ab"', b'"my-model"')
    assert _scan.respell(body, facts[7], b'"ab"', b'"x"') == body.replace(b'"ab"', b'"x"')
    assert _scan.respell(body, b"", b'"ab"', b'"x"') == body
    wrong = [array.array("I", [8, 8]).tobytes(), array.array("I", [9]).tobytes(), b"\x01\x02\x03",
             array.array("I", [len(body) - 2]).tobytes(), array.array("I", [2**32 - 1]).tobytes()]
    wrong.append(array.array("I", reversed(array.array("I", facts[7]))).tobytes())  # out of order
    for positions in wrong:
        with pytest.raises(ValueError):
            _scan.respell(body, positions, b'"ab"', b'"x"')
    with pytest.raises(TypeError):
        _scan.respell(body, facts[7], "ab", b"x")


@pytest.mark.parametrize("value", [b'""', b'"a"', b'"\\u0000"', b"0", b"-0", b"7", b"0.0", b"0.5", b"-0.0e5", b"1e-5",
                                   b"0e10", b"[]", b"[0]", b"{}", b'{"a":1}', b"true", b"false", b"null"])
def test_text_is_what_python_holds_true(value: bytes) -> None:
    chunk = b'{"model":"m","choices":[{"delta":{"content":%b}}]}' % value
    facts = check_against_decode(body_of([chunk, b'{"model":"m","choices":[]}']))
    assert facts is not None and facts[4] == bool(msgspec.json.decode(value))


@SLOW
@given(payloads=PAYLOADS, cut=st.integers(0, 400), byte=st.integers(0, 255),
       mode=st.sampled_from(["as is", "as is", "replace", "insert", "delete"]))
def test_what_the_scan_accepts_the_decode_accepts_with_the_same_facts(payloads: list[bytes], cut: int, byte: int,
                                                                      mode: str) -> None:
    body = body_of(payloads)
    if mode != "as is":  # one byte changed anywhere: most such bodies are not plain, or not JSON
        at = 7 + cut % max(1, len(body) - 7)
        body = body[:at] + (b"" if mode == "delete" else bytes([byte])) + body[at + (mode != "insert"):]
    check_against_decode(body)


@SLOW
@given(payloads=PAYLOADS, row=st.sampled_from(ROWS),
       max_tool_calls=st.sampled_from([2, 256]), name=st.sampled_from([NAME, "tiny-llama"]))
def test_the_typed_pass_over_a_scanned_run_is_the_pass_over_its_heads(payloads: list[bytes], row: tuple[str, str],
                                                                     max_tool_calls: int, name: str) -> None:
    body = body_of(payloads)
    scanned = _sse._run(body, MAX_EVENT)
    if scanned is None or scanned.facts is None:
        return
    decoded = decoded_run(body)
    assert decoded is not None and decoded.facts is None
    check = chunk_check(row_for(*row).row, max_tool_calls)
    outcomes = []
    for run in (scanned, decoded):
        ticks = iter(range(100))
        meter = Meter(lambda: 0.0)
        passed = TypedRelay(check, meter, name).run(run, lambda: float(next(ticks)))
        outcomes.append((passed, run.sse, meter.first_text_at, meter.last_at, meter.text_chunks,
                         copy.deepcopy(meter.seen)))
    assert outcomes[0] == outcomes[1]


@pytest.mark.parametrize("count", [255, 256, 257, 1100])
def test_a_run_of_more_chunks_than_the_scan_keeps_on_its_stack_reads_the_same(count: int) -> None:
    """Past 256 chunks the scan moves its chunks to the heap (and doubles that room as it goes)."""
    chunks = [b'{"model":"m","choices":[{"index":0,"delta":{"content":"%d"}}]%b}' % (i, b',"usage":{"n":%d}' % i
                                                                                 if i % 300 == 299 else b"")
              for i in range(count)]
    body = body_of(chunks)
    facts = check_against_decode(body)
    assert facts is not None and facts[0] == count and len(facts[6]) == 2 * (count // 300)
    check_positions(body, facts)
    assert facts[7] is not None and len(array.array("I", facts[7])) == count


def test_a_declined_scanned_run_decodes_its_heads_when_read() -> None:
    good = b'{"model":"tiny-llama","choices":[{"index":0,"delta":{"content":"hi"}}]}'
    refused = b'{"model":"tiny-llama","choices":[{"index":0,"delta":{"reasoning_content":"x"}}]}'
    run = _sse._run(body_of([good, refused]), MAX_EVENT)
    assert run is not None and run.facts is not None and len(run.heads) == 2
    assert not TypedRelay(chunk_check(row_for("vllm", "0.32.0").row), Meter(lambda: 0.0), NAME).run(run, lambda: 0.0)
    chunks = run.chunks()  # the relay's way for a declined run: its chunks, each with its decoded head
    assert [c.raw for c in chunks] == [good, refused] and chunks[1].head.choices[0].delta.reasoning_content == "x"


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(reads=stream(), row=st.sampled_from(ROWS), max_tool_calls=st.sampled_from([2, 256]))
def test_without_the_scan_runs_still_relay_exactly_what_the_stages_relay(reads: list[bytes], row: tuple[str, str],
                                                                        max_tool_calls: int) -> None:
    """A build without a C compiler decodes every run: that way too must stay the stages' answer."""
    family, version = row
    with without_scan():
        assert relay(True, reads, family, version, max_tool_calls, runs=True) == relay(
            False, reads, family, version, max_tool_calls)


@settings(max_examples=500, deadline=None)
@given(tail=st.binary(max_size=300))
def test_the_scan_survives_any_bytes(tail: bytes) -> None:
    for body in (b"data: {" + tail, b"data: {" + tail + b"\n\n", body_of([b'{"model":"m"}']) + b"data: {" + tail):
        check_against_decode(body)
