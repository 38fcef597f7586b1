"""The C scan (``_speedups/scan.c``) against its Python reference (``_speedups/scan_reference.py``), and the
reference against the way both stand in for: msgspec's typed decode of the heads.

Whatever the reference's ``scan_run`` accepts, the typed decode (``relay_check.Head``) must accept too, and
the facts it gives must be the ones the decoded heads give (``tests/oracle.facts_of``); whatever the C
accepts, the reference must accept, with the same facts (the C may leave out positions the reference
gives). The check over those facts must then do exactly what it does over the decode, and what the oracle
(``tests/oracle``) does. Where the C is unsure it declines, and the read is decoded, so declining is always
allowed; accepting the common case (the recordings) is asserted too, or the scan would buy nothing.
``respell`` in C is held to its Python reference (``scan_reference.respell``, which is ``streams.respell``).

The reference's tests run everywhere; the C's are skipped only where it cannot be imported (a build without
a C compiler, where ``test_layers`` checks it is built wherever gcc is).
"""

from __future__ import annotations

import array
import copy
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from msgspec import UNSET

from capyctl._speedups import scan_reference
from capyctl.adapters.engines._sse import SseParser
from capyctl.domain.fields import FIELD_TABLE, row_for
from capyctl.domain.metrics import Meter
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
from capyctl.domain.streams import Chunks, ScanFacts, payloads_of, respell
from tests.oracle import OracleCheck, facts_of, payload_spans
from tests.unit.test_relay_check import NAME, ROWS, payload, plain_chunks, recordings, told

_scan: ModuleType | None
try:
    from capyctl._speedups import scan as _scan
except ImportError:  # a build without a C compiler: the reference is still tested
    _scan = None

needs_c = pytest.mark.skipif(_scan is None, reason="the C scan was not built (no C compiler)")
SCANS = [pytest.param(scan_reference, id="python"), pytest.param(_scan, id="c", marks=needs_c)]


def scan_run(body: bytes, objects: tuple[str, ...] = OBJECT_NAMES, delta_keys: tuple[str, ...] = DELTA_KEYS) -> Any:
    """The C scan as the SSE parser runs it: told the meter's engine objects and the field table's delta keys."""
    assert _scan is not None
    return _scan.scan_run(body, objects, delta_keys)


def reference(body: bytes, objects: tuple[str, ...] = OBJECT_NAMES, delta_keys: tuple[str, ...] = DELTA_KEYS) -> Any:
    return scan_reference.scan_run(body, objects, delta_keys)


# (500 examples here; the deeper differential run is scripts/fuzz-c, 60 s under the sanitizers in .ci/run)
SLOW = settings(
    max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
_decode_head = msgspec.json.Decoder(Head).decode


def body_of(payloads: list[bytes]) -> bytes:
    return b"".join(b"data: " + p + b"\n\n" for p in payloads)


def check_positions(body: bytes, facts: ScanFacts) -> None:
    """Positions, when a scan gives them, are each chunk's model token, right after ``"model":``, the only
    occurrence of that pattern in its chunk (so respelling there is each chunk's first-occurrence splice)."""
    model, positions = facts.model, facts.positions
    if positions is None:
        return
    assert model is not None
    at = array.array("I", positions).tolist()
    spans = payload_spans(body)
    assert len(at) == len(spans), body
    for (begin, end), position in zip(spans, at, strict=False):
        assert begin < position < end and body[position - 8 : position + len(model)] == b'"model":' + model, body
        assert body[begin:end].count(b'"model":' + model) == 1, body


def check_reference(body: bytes) -> ScanFacts | None:
    """The reference's facts for ``body``, held to the typed decode's: given only where every payload decodes
    into a head and none is the engine's error event; then the same facts, and positions where each model is."""
    facts = reference(body)
    if facts is not None:
        assert type(facts) is ScanFacts
        payloads = payloads_of(body)
        assert body_of(payloads) == body and not any(b"\n" in p for p in payloads), body  # plain events alone
        heads = []
        for chunk in payloads:
            try:
                heads.append(_decode_head(chunk))
            except (msgspec.DecodeError, RecursionError) as exc:
                raise AssertionError(f"the reference accepted what the decode refuses ({exc}): {body!r}") from exc
            assert heads[-1].error is UNSET or heads[-1].choices is not UNSET, body  # no error event
        assert msgspec.structs.astuple(facts)[:7] == facts_of(heads, body), body
        check_positions(body, facts)
    return facts


def check_c(body: bytes, want: ScanFacts | None, objects: tuple[str, ...], delta_keys: tuple[str, ...]) -> Any:
    """The C's facts for ``body``, held to the reference's (``want``): given only where the reference gives
    them, and then the same, but for positions, which the C may leave out."""
    facts = scan_run(body, objects, delta_keys)
    if facts is not None:
        assert type(facts) is ScanFacts
        assert want is not None, f"the C accepted what its reference declines: {body!r}"
        assert facts.positions is None or facts.positions == want.positions, body
        assert msgspec.structs.replace(facts, positions=want.positions) == want, (body, facts, want)
        check_positions(body, facts)
    return facts


def check_against_decode(
    body: bytes, objects: tuple[str, ...] = OBJECT_NAMES, delta_keys: tuple[str, ...] = DELTA_KEYS
) -> Any:
    """The reference held to the typed decode, and the C (where built) to the reference; the C's facts where
    it was built, else the reference's."""
    told = (objects, delta_keys) == (OBJECT_NAMES, DELTA_KEYS)  # as the parser tells it: the oracle's names
    want = check_reference(body) if told else reference(body, objects, delta_keys)
    return want if _scan is None else check_c(body, want, objects, delta_keys)


@needs_c
def test_the_scan_knows_the_structs_field_for_field() -> None:
    """Its field lists are the structs' (a field it does not know it refuses; one it knows wrongly it would
    pass), and the structs are what it assumes of them: the few fields it reads typed as it reads them, the
    rest Any; a delta's unknown keys forbidden, the head's and a choice's skipped, as the scan skips them."""
    assert _scan is not None
    assert Head.__struct_fields__ == _scan.HEAD_FIELDS + OBJECT_NAMES
    assert Choice.__struct_fields__ == _scan.CHOICE_FIELDS
    assert Delta.__struct_fields__ == DELTA_KEYS == tuple(sorted(frozenset().union(*(r.delta for r in FIELD_TABLE))))
    assert not hasattr(_scan, "DELTA_FIELDS")  # the delta's keys are the field table's, passed in: no copy in C
    assert ToolCall.__struct_fields__ == _scan.TOOL_CALL_FIELDS
    typed = {
        (Head, "choices"): "list[Choice] | None | UnsetType",
        (Choice, "index"): "Index | None",
        (Choice, "delta"): "Delta | None",
        (Delta, "tool_calls"): "list[ToolCall] | None | UnsetType",
        (ToolCall, "index"): "Index | None",
    }
    for struct in (Head, Choice, Delta, ToolCall):
        assert struct.__struct_config__.forbid_unknown_fields == (struct is Delta)
        for name in struct.__struct_fields__:
            annotation = struct.__annotations__[name]
            spelt = annotation if isinstance(annotation, str) else "Any" if annotation is Any else str(annotation)
            spelt = spelt.replace("capyctl.domain.relay_check.", "").replace("msgspec.", "")
            assert spelt == typed.get((struct, name), "Any"), (struct, name, spelt)


@needs_c
def test_the_c_answers_with_the_struct_of_the_domain_read_by_name() -> None:
    """The C takes ``ScanFacts`` from ``domain/streams`` when it loads, having checked its fields are the ones
    it passes, in their order, and builds each answer by a call of it."""
    assert _scan is not None
    assert _scan.FACT_FIELDS == ScanFacts.__struct_fields__ == ScanFacts.__match_args__
    body = body_of([b'{"model":"m","choices":[{"index":0,"delta":{"content":"a"}}],"usage":{}}'])
    facts = scan_run(body)
    assert type(facts) is ScanFacts and facts == reference(body)
    assert (facts.count, facts.model, facts.text_count, facts.first_text) == (1, b'"m"', 1, 0)
    assert facts.objects == payload_spans(body)[0] and facts.positions == array.array("I", [15]).tobytes()


@pytest.mark.parametrize("scan", SCANS)
def test_scan_run_takes_bytes_and_two_tuples_of_at_most_sixteen_ascii_names(scan: ModuleType) -> None:
    body = body_of([b'{"model":"m","usage":{}}'])
    for bad in (list(OBJECT_NAMES), ("usage", 1), ("\u00e9",), tuple(f"o{i}" for i in range(17)), None):
        for args in ((body, bad, DELTA_KEYS), (body, OBJECT_NAMES, bad)):
            with pytest.raises(TypeError):
                scan.scan_run(*args)
    for args in (
        (body.decode(), OBJECT_NAMES, DELTA_KEYS),
        (body,),
        (body, OBJECT_NAMES),
        (body, OBJECT_NAMES, DELTA_KEYS, None),
    ):
        with pytest.raises(TypeError):
            scan.scan_run(*args)
    sixteen = tuple(f"o{i}" for i in range(16))
    assert scan.scan_run(body, sixteen, DELTA_KEYS).objects == ()  # usage unread: skipped, as Head would
    assert scan.scan_run(body, OBJECT_NAMES, tuple(f"d{i}" for i in range(16))).count == 1


@pytest.mark.parametrize("scan", SCANS)
def test_the_delta_keys_scan_run_is_told_are_the_ones_it_knows(scan: ModuleType) -> None:
    """A delta key the scan is not told of is refused (the decode answers); role is never text, tool_calls is
    read as a list of tool calls, any other told key is text when truthy; a refused tuple changes nothing."""

    def run(body: bytes, delta_keys: tuple[str, ...] = DELTA_KEYS) -> Any:
        return scan.scan_run(body, OBJECT_NAMES, delta_keys)

    reasoning = body_of([b'{"model":"m","choices":[{"index":0,"delta":{"reasoning":"r"}}]}'])
    assert run(reasoning, ("content", "role")) is None
    facts = run(reasoning, ("role", "reasoning"))
    assert facts.delta_keys == 0b10 and facts.text_count == 1  # its bit, and text
    role = body_of([b'{"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}'])
    facts = run(role, ("content", "role"))
    assert (facts.delta_keys, facts.top_index, facts.text_count) == (0b11, -1, 0)  # a role, an empty text: none
    calls = body_of([b'{"model":"m","choices":[{"index":0,"delta":{"tool_calls":[{"index":7}]}}]}'])
    facts = run(calls)
    assert (facts.top_index, facts.text_count) == (7, 1)  # the highest index, and text
    assert run(calls, ("tool_calls_x", "tool_calls")) is not None
    assert run(calls, ("content",)) is None
    with pytest.raises(TypeError):
        run(reasoning, ("role", 1))  # a name that is no str: refused
    assert run(reasoning, ("role", "reasoning")) is not None  # told again: the same facts
    assert run(reasoning).delta_keys == 1 << DELTA_KEYS.index("reasoning")


@pytest.mark.parametrize("scan", SCANS)
def test_the_objects_scan_run_is_told_are_the_ones_it_places(scan: ModuleType) -> None:
    """The head's object fields are the caller's names, set anew when the tuple changes: an engine object it
    is not told of is skipped like any field the head does not read."""

    def objects(body: bytes, names: tuple[str, ...]) -> Any:
        return scan.scan_run(body, names, DELTA_KEYS).objects

    body = body_of([b'{"model":"m","usage":{"n":1}}', b'{"model":"m","timings":{"t":2}}', b'{"model":"m"}'])
    spans = payload_spans(body)
    assert objects(body, OBJECT_NAMES) == (*spans[0], *spans[1])
    assert objects(body, ("usage",)) == spans[0]
    assert objects(body, ("timings", "other")) == spans[1]
    assert objects(body, ()) == ()
    assert objects(body, OBJECT_NAMES) == (*spans[0], *spans[1])  # and back
    with pytest.raises(TypeError):  # a tuple refused part way leaves the names as they were
        objects(body, ("x" + "usage", 1))  # a name that is no str: refused
    assert objects(body, OBJECT_NAMES) == (*spans[0], *spans[1])
    repeat = body_of([b'{"model":"m","usage":{},"usage":{}}'])
    assert scan.scan_run(repeat, ("usage",), DELTA_KEYS) is None  # a repeat: declined
    assert scan.scan_run(repeat, ("timings",), DELTA_KEYS) is not None  # a field the head does not read


@needs_c
def test_a_call_made_while_scan_run_lets_go_of_its_last_names_changes_nothing_it_reads_by() -> None:
    """The C keeps the last names it was told, holding their tuples, and lets go of them when told others.
    Letting go may run Python code (a finalizer), which may call it again with other names: the call that
    let go reads by its own names all the same, and the next call finds the names it was told."""
    assert _scan is not None
    body = body_of([b'{"model":"m","usage":{"n":1}}', b'{"model":"m","timings":{"t":2}}'])
    spans = payload_spans(body)
    inner: list[Any] = []

    class Names(tuple[str, ...]):
        def __del__(self) -> None:  # runs when the scan lets go of the last reference to these names
            inner.append(_scan.scan_run(body, ("timings", "x" * 3), ("content",)))

    _scan.scan_run(body, Names(("usage",)), DELTA_KEYS)  # the scan holds the only reference to the names
    facts = scan_run(body, OBJECT_NAMES, DELTA_KEYS)  # lets go of them: the finalizer calls the scan anew
    assert len(inner) == 1 and inner[0].objects == spans[1]
    assert facts.objects == (*spans[0], *spans[1]) and facts == reference(body)
    assert scan_run(body, OBJECT_NAMES, DELTA_KEYS) == facts
    assert _scan.scan_run(body, ("timings", "x" * 3), ("content",)) == inner[0]


@pytest.mark.parametrize("scan", SCANS)
def test_a_carriage_return_inside_a_payload_is_refused_by_the_scan_itself(scan: ModuleType) -> None:
    """A CR (13) is a line end to SSE: a read that holds one is the parser's general way to read (which
    normalises line ends), and the scan refuses it wherever it is, as whitespace between tokens included,
    though the parser would not hand it such a read."""
    chunks = [
        b'{"model":"m",%b"choices":[{"index":0,"delta":{"content":"a"}}]}',
        b'{"model":"m","choices":[{"index":0,"delta":{"content":"a"}}%b]}',
        b'%b{"model":"m","choices":[]}',
        b'{"model":"m","choices":[]}%b',
    ]
    plain = b'{"model":"m","choices":[]}'
    for chunk in chunks:
        spaced = body_of([plain, chunk.replace(b"%b", b" "), plain])
        assert scan.scan_run(spaced, OBJECT_NAMES, DELTA_KEYS) is not None, spaced  # a space is taken
        with_cr = body_of([plain, chunk.replace(b"%b", b"\r"), plain])
        assert scan.scan_run(with_cr, OBJECT_NAMES, DELTA_KEYS) is None, with_cr  # a CR is not


@pytest.mark.parametrize("path", recordings())
def test_every_recorded_read_is_scanned_as_the_decode_reads_it(path: Path) -> None:
    data = path.read_bytes()
    body = data[:-14] if data.endswith(b"\n\ndata: [DONE]\n\n") else data
    facts = check_against_decode(body)
    if not path.name.startswith("adv_") and b"\r" not in body:  # a plain recorded stream: the scan takes it
        assert facts is not None and facts.positions is not None, path


CASES = [
    # (payload, whether the decode takes it) - the edges of strings, numbers, nesting and the structs
    (b'{"id":"a\x7f","model":"m"}', True),
    (b'{"id":"a\x01","model":"m"}', False),
    (b'{"id":"caf\xc3\xa9 \xf0\x9f\x98\x80","model":"m"}', True),
    (b'{"model":"m","usage":"\xed\xa0\x80"}', False),
    (b'{"model":"m","usage":"\xc0\x80"}', False),
    (b'{"model":"m","usage":"\xf4\x90\x80\x80"}', False),
    (b'{"model":"m","error":"\xe0\x9f\xbf","choices":[]}', False),
    (b'{"model":"m","usage":"\xc3"}', False),
    (b'{"id":"\\u00e9\\n\\t\\"\\\\\\/","model":"m"}', True),
    (b'{"id":"\\x","model":"m"}', False),
    (b'{"id":"\\ud83d\\ude00","model":"m"}', True),
    (b'{"id":"\\udc00","model":"m"}', False),
    (b'{"model":"m","usage":1e400}', False),
    (b'{"id":1e99,"model":"m"}', True),
    (b'{"id":-0.0e-5,"model":"m"}', True),
    (b'{"id":01,"model":"m"}', False),
    (b'{"id":1.,"model":"m"}', False),
    (b'{"id":-,"model":"m"}', False),
    (b'{"id":' + b"9" * 41 + b',"model":"m"}', True),
    (b'{"id":tru,"model":"m"}', False),
    (b'{"model":"m","choices":[{"index":-0}]}', True),
    (b'{"model":"m","choices":[{"index":1.0}]}', False),
    (b'{"model":"m","choices":[{"index":' + b"9" * 18 + b"}]}", True),
    (b'{"model":"m","choices":[{"index":' + b"9" * 19 + b"}]}", True),
    (b'{"model":"m","choices":[{"index":' + b"9" * 40 + b"}]}", True),
    (b'{"model":"m","choices":[{"index":-1}]}', False),
    (b'{"model":"m","choices":[{"index":true}]}', False),
    (b'{"model":"m","model":"m"}', True),
    (b'{"model":"m","foo":1}', True),
    (b'{"mod\\u0065l":"m"}', True),
    (b'{"model":"m","choices":[null]}', False),
    (b'{"model":"m","choices":{}}', False),
    (b'{"model":"m","choices":[{"delta":{"content":"a","x":1}}]}', False),
    (b'{"model":"m","choices":[{"delta":{"tool_calls":[{"index":3,"id":"c"}]}}]}', True),
    (b'{"model":"m","choices":[{"delta":{"tool_calls":[{"index":9223372036854775807}]}}]}', True),
    (b'{"model":"m","choices":[{"delta":{"tool_calls":[{"index":18446744073709551616}]}}]}', True),
    (b'{"model":"m","choices":[{"delta":{"tool_calls":[{"index":"1"}]}}]}', False),
    (b'{"model":"m","choices":[{"delta":{"tool_calls":{}}}]}', False),
    (b'{"model":"m","error":{"message":"x"}}', True),
    (b'{"model":"m","error":1,"choices":[]}', True),
    (b'{"model":"m","usage":' + b"[" * 70 + b"]" * 70 + b"}", True),
    (b'{"model":"m"}x', False),
    (b'{"model":"m",}', False),
    (b'{"model" : "m" , "choices" : [ ] }\r', True),
    (b"{}", True),
    (b'{"model":"m","choices":[{"delta":{"reasoning_content":"x","tool_calls":[{"index":9}]}}],"choices":[]}', True),
    (b'{"model":"m","usage":{"a":1},"usage":null}', True),
    (b'{"model":null}', True),
    (b'{"model":"m\\u0000"}', True),
    (b'{"model":"m","choices":[{"delta":null}]}', True),
    (b'{"model":{"model":"m"}}', True),
    (b"[]", False),
    (b'{"model":"m","choices":[{"index":0,"delta":{"content":"a"},"model":"m"}]}', True),
    (b"", False),
]


@pytest.mark.parametrize("chunk, valid", CASES)
def test_the_scan_takes_no_chunk_the_decode_refuses(chunk: bytes, valid: bool) -> None:
    try:
        _decode_head(chunk)
        decodes = True
    except (msgspec.DecodeError, RecursionError):
        decodes = False
    assert decodes == valid, chunk  # the case is what it says it is: the decode's own verdict
    plain = b'{"model":"m","choices":[{"index":0,"delta":{"content":"a"}}]}'
    for payloads in ([chunk], [chunk, plain], [plain, chunk]):
        check_against_decode(body_of(payloads))


@pytest.mark.parametrize("index", [0, 255, 10**17, 10**18 - 1, 10**18, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**40])
@pytest.mark.parametrize("where", ["choice", "tool call"])
def test_an_index_of_up_to_eighteen_digits_is_read_and_a_longer_one_left_to_the_decode(index: int, where: str) -> None:
    """The C reads an index into a 64-bit integer: it declines one past 18 digits before it could overflow
    (the decode, and the reference, read any size); what the check makes of either is the decode's and the
    oracle's answer."""
    delta = b'{"content":"a"}' if where == "choice" else b'{"tool_calls":[{"index":%d}]}' % index
    choice = b'{"index":%d,"delta":%b}' % (index if where == "choice" else 0, delta)
    body = body_of([b'{"model":"m","choices":[%b]}' % choice, b'{"model":"m","choices":[]}'])
    facts = check_against_decode(body)
    want = reference(body)
    assert want is not None and want.top_index == (index if where == "tool call" else -1)
    if _scan is not None:
        assert (facts is None) == (len(str(index)) > 18)
    outcomes = []
    ways = ("c", "reference", "python", "oracle") if _scan is not None else ("reference", "python", "oracle")
    for way in ways:
        meter = Meter(lambda: 0.0)
        rules = ChunkRules(row_for("vllm", "0.32.0").row, "here")
        check: Any = (
            OracleCheck(row_for("vllm", "0.32.0").row, "here", NAME)
            if way == "oracle"
            else StreamCheck(rules, meter, NAME, lambda: 1.0)
        )
        scanned = {"c": facts, "reference": want}.get(way)
        try:
            sent = (
                check.check(payloads_of(body), meter, 1.0)
                if way == "oracle"
                else check.check(Chunks(body, None, scanned, scan_reference.respell))
            )
        except Refused as refused:
            sent = (refused.sent, told(refused.error))
        outcomes.append((sent, meter.text_chunks))
    assert all(outcome == outcomes[0] for outcome in outcomes)
    refused = where == "tool call" and index >= 256
    assert isinstance(outcomes[0][0], tuple) == refused


@pytest.mark.parametrize("scan", SCANS)
def test_the_scan_reads_what_each_delta_sends(scan: ModuleType) -> None:
    chunks = [
        b'{"model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}',
        b'{"model":"m","choices":[{"index":0,"delta":{"reasoning":0.0}},{"delta":{"content":[0]}}]}',
        b'{"model":"m","choices":[{"delta":{"tool_calls":[{"index":7},{"index":null}]}}],"usage":null}',
        b'{"model":"m","choices":[{"delta":{"reasoning_content":null,"tool_calls":[]}}],"usage":{}}',
    ]
    body = body_of(chunks)
    check_against_decode(body)
    facts = scan.scan_run(body, OBJECT_NAMES, DELTA_KEYS)
    assert facts == ScanFacts(
        count=4,
        model=b'"m"',
        delta_keys=0b11111,
        top_index=7,
        text_count=2,
        first_text=1,
        objects=payload_spans(body)[3],
        positions=array.array("I", [m.start() + 8 for m in re.finditer(b'"model":', body)]).tobytes(),
    )


@pytest.mark.parametrize("scan", SCANS)
def test_the_scan_declines_what_the_check_must_decode(scan: ModuleType) -> None:
    plain = b'{"model":"m","choices":[{"index":0,"delta":{"content":"a"}}]}'
    odd = [
        b'{"error":{"message":"x"},"model":"m"}',  # the engine's error event
        b'{"model":"n","choices":[]}',
        b'{"choices":[]}',  # another model, or none beside one
        b'{"model":1,"choices":[]}',  # a model that is no string
        b'{"model":"m","choices":[],"choices":[]}',  # a repeat (the decode keeps the last)
        b'{"model":"m","choices":[{"delta":{"content":"a","content":"b"}}]}',
    ]
    odd_to_c = [  # what the C declines, and the reference reads as the decode does
        b'{"model":"\\u006d","choices":[]}',  # the same model, escaped
        b'{"mod\\u0065l":"m","choices":[]}',  # an escaped field name
    ]
    for chunk in odd + odd_to_c + [b'{"model":"m","choices":[],"id":1,"id":2}']:  # (a skipped field: taken)
        body = body_of([plain, chunk])
        check_against_decode(body)
        declined = chunk in odd or (scan is _scan and chunk in odd_to_c)
        assert (scan.scan_run(body, OBJECT_NAMES, DELTA_KEYS) is None) == declined, chunk
    for not_plain in (
        b"data: {}\n\n: keep-alive\n\n",
        b"data: {}\r\n\r\n",
        b"data:{}\n\n",
        b"data: {}\n\n\n",
        b"data: {}\n",
        b'data: {"model":"m",\ndata: "choices":[]}\n\n',
        b"data: [DONE]\n\n",
    ):
        assert scan.scan_run(body_of([plain]) + not_plain, OBJECT_NAMES, DELTA_KEYS) is None, not_plain


@pytest.mark.parametrize("scan", SCANS)
def test_positions_are_given_where_the_model_pattern_is_each_chunks_model_field_alone(scan: ModuleType) -> None:
    """The C gives them only where it can tell from its one pass (each model field written tight, no key
    below the head ending in "model"); the reference wherever the pattern is each chunk's model field alone."""
    plain = b'{"model":"m","choices":[]}'
    for chunk, in_c, in_python in (
        (plain, True, True),
        (b'{"choices":[],"model":"m"}', True, True),
        (b'{"model" :"m","choices":[]}', False, False),
        (b'{"model": "m","choices":[]}', False, False),
        (b'{"choices":[{"logprobs":{"model":"m"}}],"model":"m"}', False, False),
        (b'{"choices":[{"delta":{"content":"\\"model\\":\\"m\\""}}],"model":"m"}', True, True),
        (b'{"usage":{"x":[{"model":1}]},"model":"m"}', False, True),
        (b'{"usage":{"xmodel":1},"model":"m"}', False, True),
        (b'{"xmodel":1,"model":"m"}', True, True),
        (b'{"usage":{"model":"m"},"model" : "m"}', False, False),  # the pattern once, but not the head's
        (b'{"usage":{"a\\"model":"m"},"model" : "m"}', False, False),
    ):
        body = body_of([plain, chunk])
        check_against_decode(body)
        facts = scan.scan_run(body, OBJECT_NAMES, DELTA_KEYS)
        spliceable = in_c if scan is _scan else in_python
        assert facts is not None and (facts.positions is not None) is spliceable, chunk


@needs_c
def test_respell_in_c_is_its_python_reference() -> None:
    body = body_of([b'{"model":"ab","choices":[]}', b'{"choices":[],"model":"ab"}'])
    assert _scan is not None and scan_reference.respell is respell  # (the reference is the domain's own)
    positions = scan_run(body, OBJECT_NAMES).positions
    assert positions is not None
    for new in (b'"my-model"', b'"x"', b'"ab"', b""):
        assert (
            _scan.respell(body, positions, b'"ab"', new)
            == respell(body, positions, b'"ab"', new)
            == body.replace(b'"ab"', new)
        )
    assert _scan.respell(body, b"", b'"ab"', b'"x"') == respell(body, b"", b'"ab"', b'"x"') == body
    wrong = [
        array.array("I", [8, 8]).tobytes(),
        array.array("I", [9]).tobytes(),
        b"\x01\x02\x03",
        array.array("I", [len(body) - 2]).tobytes(),
        array.array("I", [2**32 - 1]).tobytes(),
        array.array("I", reversed(array.array("I", positions))).tobytes(),
    ]  # out of order
    for positions in wrong:
        for way in (_scan.respell, respell):
            with pytest.raises(ValueError):
                way(body, positions, b'"ab"', b'"x"')
    with pytest.raises(TypeError):
        _scan.respell(body, positions, "ab", b"x")  # a str: refused


@needs_c
@SLOW
@given(
    body=st.binary(max_size=200),
    positions=st.lists(st.integers(0, 220), max_size=4),
    old=st.binary(min_size=1, max_size=3),
    new=st.binary(max_size=5),
)
def test_respell_in_c_agrees_with_python_on_any_input(
    body: bytes, positions: list[int], old: bytes, new: bytes
) -> None:
    """(A token is a JSON string, never empty: an empty one at an offset past the end is refused in C, and
    taken by the Python reference, whose slice there is empty.)"""
    assert _scan is not None
    at = array.array("I", positions).tobytes()
    answers = []
    for way in (_scan.respell, respell):
        try:
            answers.append(way(body, at, old, new))
        except ValueError:
            answers.append(ValueError)
    assert answers[0] == answers[1]


@pytest.mark.parametrize(
    "value",
    [
        b'""',
        b'"a"',
        b'"\\u0000"',
        b"0",
        b"-0",
        b"7",
        b"0.0",
        b"0.5",
        b"-0.0e5",
        b"1e-5",
        b"0e10",
        b"[]",
        b"[0]",
        b"{}",
        b'{"a":1}',
        b"true",
        b"false",
        b"null",
    ],
)
@pytest.mark.parametrize("scan", SCANS)
def test_text_is_what_python_holds_true(scan: ModuleType, value: bytes) -> None:
    chunk = b'{"model":"m","choices":[{"delta":{"content":%b}}]}' % value
    body = body_of([chunk, b'{"model":"m","choices":[]}'])
    check_against_decode(body)
    facts = scan.scan_run(body, OBJECT_NAMES, DELTA_KEYS)
    assert facts is not None and facts.text_count == bool(msgspec.json.decode(value))


PAYLOADS = st.one_of(plain_chunks(), st.lists(payload(), min_size=1, max_size=6))


@SLOW
@given(
    payloads=PAYLOADS,
    cut=st.integers(0, 400),
    byte=st.integers(0, 255),
    mode=st.sampled_from(["as is", "as is", "replace", "insert", "delete"]),
)
def test_what_the_scan_accepts_the_decode_accepts_with_the_same_facts(
    payloads: list[bytes], cut: int, byte: int, mode: str
) -> None:
    body = body_of(payloads)
    if mode != "as is":  # one byte changed anywhere: most such bodies are not plain, or not JSON
        at = 7 + cut % max(1, len(body) - 7)
        body = body[:at] + (b"" if mode == "delete" else bytes([byte])) + body[at + (mode != "insert") :]
    check_against_decode(body)


def checked(
    body: bytes, facts: Any, respelling: Any, row: tuple[str, str], max_tool_calls: int, name: str
) -> tuple[Any, ...]:
    """What one read's check sends, refuses, keeps and meters."""
    ticks = iter(range(100))
    meter = Meter(lambda: 0.0)
    check = StreamCheck(ChunkRules(row_for(*row).row, "here", max_tool_calls), meter, name, lambda: float(next(ticks)))
    try:
        sent: Any = check.check(Chunks(body, None, facts, respelling))
    except Refused as refused:
        sent = (refused.sent, told(refused.error))
    return sent, check.failure, meter.first_text_at, meter.last_at, meter.text_chunks, copy.deepcopy(meter.seen)


@SLOW
@given(
    payloads=PAYLOADS,
    row=st.sampled_from(ROWS),
    max_tool_calls=st.sampled_from([2, 256]),
    name=st.sampled_from([NAME, "tiny-llama", "caf\u00e9"]),
)
def test_the_check_over_the_scans_facts_is_the_check_over_the_decode_and_the_oracle(
    payloads: list[bytes], row: tuple[str, str], max_tool_calls: int, name: str
) -> None:
    body = body_of(payloads)
    want = reference(body)
    decoded = checked(body, None, None, row, max_tool_calls, name)
    respellings = [respell, None] if _scan is None else [_scan.respell, respell, None]
    for facts in [want] if _scan is None else [scan_run(body, OBJECT_NAMES), want]:
        if facts is not None:  # with the C respell, the Python one, and none (each chunk's splice)
            for respelling in respellings:
                assert checked(body, facts, respelling, row, max_tool_calls, name) == decoded
    if want is not None:
        oracle = OracleCheck(row_for(*row).row, "here", name, max_tool_calls)
        meter = Meter(lambda: 0.0)
        try:
            sent: Any = oracle.check(payloads, meter, 0.0)
        except Refused as refused:
            sent = (refused.sent, told(refused.error))
        assert (sent, oracle.failure, meter.text_chunks, meter.seen) == (decoded[0], decoded[1], decoded[4], decoded[5])


@pytest.mark.parametrize("scan", SCANS)
@pytest.mark.parametrize("count", [255, 256, 257, 1100])
def test_a_read_of_more_chunks_than_the_scan_keeps_on_its_stack_reads_the_same(scan: ModuleType, count: int) -> None:
    """Past 256 chunks the C moves its chunks to the heap (and doubles that room as it goes)."""
    chunks = [
        b'{"model":"m","choices":[{"index":0,"delta":{"content":"%d"}}]%b}'
        % (i, b',"usage":{"n":%d}' % i if i % 300 == 299 else b"")
        for i in range(count)
    ]
    body = body_of(chunks)
    check_against_decode(body)
    facts = scan.scan_run(body, OBJECT_NAMES, DELTA_KEYS)
    assert facts is not None and facts.count == count and len(facts.objects) == 2 * (count // 300)
    assert facts.positions is not None and len(array.array("I", facts.positions)) == count
    assert checked(body, facts, scan.respell, ROWS[0], 256, NAME) == checked(body, None, None, ROWS[0], 256, NAME)


@pytest.mark.parametrize("scan", SCANS)
def test_a_refused_chunk_in_a_scanned_read_is_told_by_the_decode_after_the_chunks_before_it(scan: ModuleType) -> None:
    good = b'{"model":"tiny-llama","choices":[{"index":0,"delta":{"content":"hi"}}]}'
    refused = b'{"model":"tiny-llama","choices":[{"index":0,"delta":{"reasoning_content":"x"}}]}'
    (chunks,) = SseParser(scan=scan).feed(body_of([good, refused]))
    assert isinstance(chunks, Chunks) and chunks.facts is not None  # the scan reads it; the row refuses it
    sent, failure, first_text_at, last_at, texts, seen = checked(
        chunks.sse, chunks.facts, chunks.respell, ("vllm", "0.32.0"), 256, NAME
    )
    assert (
        sent
        == (
            body_of([good.replace(b"tiny-llama", NAME.encode())]),
            ("UnverifiedStream", "unverified_stream", sent[1][2]),
        )
        and "'reasoning_content'" in sent[1][2]
    )
    assert texts == 1 and failure is None


@settings(max_examples=500, deadline=None)
@given(tail=st.binary(max_size=300), objects=st.sampled_from([OBJECT_NAMES, (), ("usage", "model", "choices")]))
def test_the_scan_survives_any_bytes(tail: bytes, objects: tuple[str, ...]) -> None:
    for body in (b"data: {" + tail, b"data: {" + tail + b"\n\n", body_of([b'{"model":"m"}']) + b"data: {" + tail):
        if _scan is not None:
            scan_run(body, objects)
        reference(body, objects)
        check_against_decode(body)
