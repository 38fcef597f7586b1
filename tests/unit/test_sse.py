"""The engine SSE parser: the same payloads, comments and [DONE] whatever the reads, on every way through it.

A read of whole plain events takes the parser's fast way (with the C scan's
facts when ``capyctl._speedups.scan`` is built and ``scan=True``); any other
read takes the general way. The batching of payloads into ``Chunks`` follows
the reads, so streams cut differently are compared by what they carry: each
payload (``payload_list``), each comment and each [DONE], in order.
"""

from __future__ import annotations

import array
import random
import re
from pathlib import Path
from typing import Any

import msgspec
import pytest

from capyctl.adapters.engines._sse import SseParser, scan_run
from capyctl.domain.errors import EdgeError
from capyctl.domain.relay_check import Head
from capyctl.domain.streams import DONE, Chunks, Comment, Done, StreamEvent, payloads_of, respell
from tests.oracle import facts_of

_decode_head = msgspec.json.Decoder(Head).decode
RECORDINGS = Path(__file__).parents[1] / "contract" / "recordings"
RECORDED = [
    "vllm/0.32.0/chat_stream_usage.sse",
    "vllm/0.32.0/chat_stream_tools.sse",
    "llamacpp/0.6.0/adv_split_utf8.sse",
    "llamacpp/0.6.0/adv_error_midstream.sse",
    "sglang/0.5.23/chat_stream_usage.sse",
]
SCANS = [pytest.param(True, id="scan"), pytest.param(False, id="no-scan")]
# a stream with every kind of event: plain data, a comment, a payload of two lines, a data line without its
# space, fields that are not data, a block with no data line, and [DONE]
MIXED = (
    b'data: {"a":1}\n\n: keep-alive\n\ndata: {"b":\ndata: 2}\n\ndata:{"c":"\xc3\xa9\xe2\x82\xac"}\n\n'
    b'event: x\nid: 7\ndata: {"d":4}\n\nevent: ping\n\ndata: {"e":5}\n\ndata: [DONE]\n\n'
)
MIXED_CARRIES = [
    ("data", b'{"a":1}'),
    ("comment", b": keep-alive"),
    ("data", b'{"b":\n2}'),
    ("data", b'{"c":"\xc3\xa9\xe2\x82\xac"}'),
    ("data", b'{"d":4}'),
    ("data", b'{"e":5}'),
    ("done",),
]


class GeneralOnly(SseParser):
    """Every read the general way: the reference the fast way is held to."""

    def _plain(self, data: bytes) -> list[StreamEvent] | None:
        return None


class Watched(SseParser):
    """Notes, read by read, whether the fast way took it."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.fast: list[bool] = []

    def _plain(self, data: bytes) -> list[StreamEvent] | None:
        events = super()._plain(data)
        self.fast.append(events is not None)
        return events


def carried(events: list[StreamEvent]) -> list[tuple[Any, ...]]:
    """What events carry, whatever their batching: ("data", payload) each, ("comment", raw), ("done",)."""
    out: list[tuple[Any, ...]] = []
    for event in events:
        if isinstance(event, Chunks):
            out += [("data", payload) for payload in event.payload_list()]
        elif isinstance(event, Comment):
            out.append(("comment", event.raw))
        else:
            assert event is DONE
            out.append(("done",))
    return out


def shape(events: list[StreamEvent]) -> list[tuple[Any, ...]]:
    """The events themselves, batching included (Chunks by their bytes and payloads, whatever facts they hold)."""
    return [
        ("chunks", e.sse, e.payload_list())
        if isinstance(e, Chunks)
        else ("comment", e.raw)
        if isinstance(e, Comment)
        else ("done",)
        for e in events
    ]


def cut(data: bytes, at: list[int]) -> list[bytes]:
    edges = [0, *sorted(at), len(data)]
    return [data[a:b] for a, b in zip(edges, edges[1:], strict=False)]


def by_size(data: bytes, size: int) -> list[bytes]:
    return [data[start : start + size] for start in range(0, len(data), size)]


def parse(reads: list[bytes], parser: SseParser | None = None) -> list[StreamEvent]:
    parser = parser or SseParser()
    events: list[StreamEvent] = []
    for read in reads:
        events += parser.feed(read)
    return events + parser.close()


def recorded(name: str) -> tuple[bytes, list[tuple[Any, ...]]]:
    """A recording and what it carries, read off its blocks independently of the parser."""
    data = (RECORDINGS / name).read_bytes()
    blocks = [block for block in data.split(b"\n\n") if block]
    assert all(block.startswith(b"data: ") and b"\n" not in block and b"\r" not in block for block in blocks)
    return data, [("done",) if block == b"data: [DONE]" else ("data", block[6:]) for block in blocks]


# --- any cut, any line end ------------------------------------------------------------------------------


@pytest.mark.parametrize("scan", SCANS)
@pytest.mark.parametrize("size", [1, 7, 64, 1000, 10**9])
@pytest.mark.parametrize("name", RECORDED)
def test_a_recorded_stream_carries_the_same_at_any_boundary_byte_for_byte(name: str, size: int, scan: bool) -> None:
    data, expected = recorded(name)
    events = parse(by_size(data, size), SseParser(scan=scan))
    assert carried(events) == expected
    sse = b"".join(event.sse for event in events if isinstance(event, Chunks))
    assert sse + (b"data: [DONE]\n\n" if expected[-1] == ("done",) else b"") == data  # relayed as the engine sent it
    for event in events:
        if isinstance(event, Chunks):
            assert payloads_of(event.sse) == event.payload_list()


@pytest.mark.parametrize("scan", SCANS)
@pytest.mark.parametrize("name", RECORDED)
def test_a_recorded_stream_cut_at_random_carries_what_one_read_carries(name: str, scan: bool) -> None:
    data, expected = recorded(name)
    rng = random.Random(name)
    for _ in range(50):
        reads = cut(data, rng.sample(range(1, len(data)), rng.randint(1, 40)))
        assert carried(parse(reads, SseParser(scan=scan))) == expected, reads


@pytest.mark.parametrize("eol", [b"\n", b"\r\n", b"\r"], ids=["LF", "CRLF", "CR"])
def test_every_kind_of_event_cut_at_every_seam_carries_the_same(eol: bytes) -> None:
    data = MIXED.replace(b"\n", eol)
    assert carried(parse([data])) == MIXED_CARRIES
    for at in range(1, len(data)):
        for parser in (SseParser(), SseParser(scan=False), GeneralOnly()):
            assert carried(parse(cut(data, [at]), parser)) == MIXED_CARRIES, (at, type(parser).__name__)
    assert carried(parse(by_size(data, 1))) == MIXED_CARRIES  # a byte a read: every seam at once


def test_random_streams_cut_at_random_carry_what_one_read_carries() -> None:
    pieces = [
        b'data: {"a":1}',
        b": ping",
        b'data: {"b":\ndata: 2}',
        b"data: [DONE]",
        b"event: x",
        b'data:{"c":"\xc3\xa9"}',
        b'id: 1\ndata: {"d":4}',
        b"data: ",
        b"data",
        b":",
        b'data: {"e":5}\n: c',
    ]
    rng = random.Random(29)
    for _ in range(1500):
        eol = rng.choice([b"\n", b"\r\n", b"\r"])
        events = [rng.choice(pieces) for _ in range(rng.randint(1, 6))]
        lf = (b"\n" if rng.random() < 0.2 else b"") + b"".join(event + b"\n\n" for event in events)
        whole = carried(parse([lf], GeneralOnly()))
        data = lf.replace(b"\n", eol)
        reads = cut(data, rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(0, 8))))
        for parser in (SseParser(), SseParser(scan=False), GeneralOnly()):
            assert carried(parse(reads, parser)) == whole, (reads, type(parser).__name__)


# --- line ends, comments, several lines -----------------------------------------------------------------


@pytest.mark.parametrize("size", [1, 2, 3, 10**9])
def test_crlf_and_lone_cr_line_ends_with_utf8_split_anywhere(size: int) -> None:
    payload = '{"choices":[{"index":0,"delta":{"content":"h\u00e9\u20ac"}}]}'.encode()
    for eol in (b"\r\n", b"\r"):
        data = b"data: " + payload + eol + eol + b"data: [DONE]" + eol + eol
        assert carried(parse(by_size(data, size))) == [("data", payload), ("done",)], eol


def test_a_cr_that_ends_a_read_and_the_lf_that_begins_the_next_are_one_line_end() -> None:
    for scan in (True, False):
        parser = SseParser(scan=scan)
        assert parser.feed(b'data: {"a":1}\r') == []
        assert parser.feed(b"\n\r") == []  # CR LF, then a CR that may begin a CR LF: not yet the event's end
        assert carried(parser.feed(b"\n")) == [("data", b'{"a":1}')]  # it did: one blank line, not two
        assert carried(parser.feed(b'data: {"b":2}\r\n\r\n')) == [("data", b'{"b":2}')]
        assert parser.close() == []
        lone = SseParser(scan=scan)  # a CR at a read's end, and no LF after it: a line end all the same
        assert lone.feed(b'data: {"a":1}\r') == []
        assert carried(lone.feed(b'\rdata: {"b":2}\r\r')) == [("data", b'{"a":1}')]
        assert carried(lone.close()) == [("data", b'{"b":2}')]
        lines = SseParser(scan=scan)  # a CR LF cut inside a payload of two lines: one line end, not a blank line
        assert lines.feed(b'data: {"a":\r') == []
        assert carried(lines.feed(b"\ndata: 1}\r\n\r\n")) == [("data", b'{"a":\n1}')]


def test_comments_come_in_order_between_the_payloads() -> None:
    data = b': ping\n\ndata: {"a":1}\n\ndata: {"b":2}\n\n: one\n: two\n\ndata: {"c":3}\n\n'
    events = parse([data])
    assert shape(events) == [
        ("comment", b": ping"),
        ("chunks", b'data: {"a":1}\n\ndata: {"b":2}\n\n', [b'{"a":1}', b'{"b":2}']),
        ("comment", b": one\n: two"),
        ("chunks", b'data: {"c":3}\n\n', [b'{"c":3}']),
    ]
    assert shape(parse([b": keep-alive\n\n"])) == [("comment", b": keep-alive")]


def test_a_payload_of_several_lines_comes_in_chunks_of_its_own() -> None:
    data = b'data: {"x":0}\n\ndata: {"a":\ndata: 1}\n\ndata: {"y":2}\n\n'
    for parser in (SseParser(), SseParser(scan=False), GeneralOnly()):
        events = parse([data], parser)
        assert [type(e) for e in events] == [Chunks, Chunks, Chunks]
        assert [e.payload_list() for e in events if isinstance(e, Chunks)] == [
            [b'{"x":0}'],
            [b'{"a":\n1}'],
            [b'{"y":2}'],
        ]


def test_fields_other_than_data_and_blocks_without_data_carry_nothing() -> None:
    data = b'event: message\nid: 3\nretry: 10\ndata: {"a":1}\n\nevent: ping\n\n\n\ndata:  {"b":2}\n\n'
    assert carried(parse([data])) == [("data", b'{"a":1}'), ("data", b' {"b":2}')]  # one space taken, no more


def test_the_engines_error_event_is_a_payload_like_any_other() -> None:
    data = b'data: {"a":1}\n\ndata: {"error":{"code":500,"message":"boom"}}\n\n'
    assert carried(parse([data])) == [("data", b'{"a":1}'), ("data", b'{"error":{"code":500,"message":"boom"}}')]


# --- close ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tail, expected",
    [
        (b'data: {"a":1}', [("data", b'{"a":1}')]),
        (b'data: {"a":1}\n', [("data", b'{"a":1}')]),
        (b'data: {"a":1}\r\n', [("data", b'{"a":1}')]),
        (b'data: {"a":\ndata: 1}\n', [("data", b'{"a":\n1}')]),
        (b": bye\n", [("comment", b": bye")]),
        (b"data: [DONE]\n", [("done",)]),
        (b"event: x\n", []),
    ],
)
def test_close_gives_the_event_the_engine_did_not_end(tail: bytes, expected: list[tuple[Any, ...]]) -> None:
    for size in (1, 5, 10**9):
        parser = SseParser()
        head = [e for read in by_size(b'data: {"z":0}\n\n' + tail, size) for e in parser.feed(read)]
        assert carried(head) == [("data", b'{"z":0}')]
        assert carried(parser.close()) == expected
        assert parser.close() == []  # given once


def test_close_after_a_whole_stream_gives_nothing() -> None:
    parser = SseParser()
    assert carried(parser.feed(b'data: {"a":1}\n\ndata: [DONE]\n\n')) == [("data", b'{"a":1}'), ("done",)]
    assert parser.close() == []


# --- the size limit -------------------------------------------------------------------------------------


def event_of(size: int) -> bytes:
    """A one-line data event of exactly ``size`` bytes, its blank line not counted."""
    head = b'data: {"x":"'
    return head + b"a" * (size - len(head) - 2) + b'"}'


@pytest.mark.parametrize("eol", [b"\n", b"\r\n"], ids=["LF", "CRLF"])
def test_an_event_exactly_at_the_limit_is_accepted_at_any_cut(eol: bytes) -> None:
    event = event_of(300)
    data = b'data: {"a":1}' + eol + eol + event + eol + eol + b'data: {"b":2}' + eol + eol
    expected = [("data", b'{"a":1}'), ("data", event[6:]), ("data", b'{"b":2}')]
    for at in range(1, len(data)):
        for scan in (True, False):
            assert carried(parse(cut(data, [at]), SseParser(max_event=300, scan=scan))) == expected, at
    assert carried(parse(by_size(data, 1), SseParser(max_event=300))) == expected
    assert carried(parse([event + eol + eol], SseParser(max_event=300))) == [("data", event[6:])]  # the fast way's


@pytest.mark.parametrize("eol", [b"\n", b"\r\n"], ids=["LF", "CRLF"])
def test_one_byte_over_the_limit_is_refused_at_any_cut(eol: bytes) -> None:
    data = b'data: {"a":1}' + eol + eol + event_of(301) + eol + eol
    for at in [*range(1, len(data)), None]:
        for scan in (True, False):
            reads = [data] if at is None else cut(data, [at])
            with pytest.raises(EdgeError, match="larger than the limit of 300 bytes"):
                parse(reads, SseParser(max_event=300, scan=scan))
    with pytest.raises(EdgeError, match="larger than the limit of 300 bytes"):
        parse(by_size(data, 1), SseParser(max_event=300))
    with pytest.raises(EdgeError, match="larger than the limit of 300 bytes"):  # never ended: refused at close too
        parse([event_of(301)], SseParser(max_event=300))


def test_a_payload_of_several_lines_counts_all_its_lines_against_the_limit() -> None:
    block = b'data: {"a":\ndata: "' + b"b" * 100 + b'"}'
    assert carried(parse([block + b"\n\n"], SseParser(max_event=len(block)))) == [
        ("data", b'{"a":\n"' + b"b" * 100 + b'"}')
    ]
    with pytest.raises(EdgeError):
        parse([block + b"\n\n"], SseParser(max_event=len(block) - 1))


def test_an_event_that_never_ends_is_refused_as_soon_as_it_passes_the_limit() -> None:
    head = b'data: {"choices":[{"index":0,"delta":{"content":"'
    for piece in (64 * 1024, 1000, 1 << 20):
        parser = SseParser(max_event=256 * 1024)
        fed = 0
        with pytest.raises(EdgeError, match="larger than the limit of 262144 bytes"):
            parser.feed(head)
            while fed < 4 * 1024 * 1024:  # an event that never ends: refused long before this
                parser.feed(b"a" * piece)
                fed += piece
        assert fed <= 256 * 1024 + piece  # refused as soon as the limit was passed, not at the end


def test_many_small_events_in_one_read_are_not_taken_for_one_large_event() -> None:
    events = [b'data: {"i":%d,"pad":"%s"}\n\n' % (i, b"p" * 40) for i in range(50)]
    read = b"".join(events) + b"data: [DONE]\n\n"
    limit = max(len(event) for event in events) - 2
    for scan in (True, False):
        got = parse([read], SseParser(max_event=limit, scan=scan))
        assert carried(got) == [("data", event[6:-2]) for event in events] + [("done",)]


# --- the fast way, the general way, with and without the C scan -----------------------------------------


PLAIN_READS = [
    pytest.param(b'data: {"a":1}\n\n', id="one-event"),
    pytest.param(b'data: {"a":1}\n\ndata: {"b":2}\n\ndata: {"c":3}\n\n', id="three-events"),
    pytest.param(b'data: {"a":1}\n\ndata: [DONE]\n\n', id="one-and-done"),
    pytest.param(b'data: {"a":1}\n\ndata: {"b":2}\n\ndata: [DONE]\n\n', id="two-and-done"),
    pytest.param((RECORDINGS / "vllm/0.32.0/chat_stream_usage.sse").read_bytes(), id="vllm-recording"),
]
OTHER_READS = [  # they begin and end as plain reads do, and are not
    pytest.param(b'data: {"a":1}\n\n: ping\n\ndata: {"b":2}\n\n', id="a-comment-among"),
    pytest.param(b'data: {"a":1}\n\ndata: [DONE]\n\ndata: {"b":2}\n\n', id="done-then-more"),
    pytest.param(b'data: {"a":1}\n\ndata: [DONE]\n\ndata: [DONE]\n\n', id="done-twice"),
    pytest.param(b'data: {"a":1}\n\ndata: {"b":\ndata: 2}\n\n', id="several-lines"),
    pytest.param(b'data: {"a":1}\n\nevent: x\ndata: {"b":2}\n\n', id="another-field"),
    pytest.param(b'data: {"a":1}\n\ndata:{"b":2}\n\n', id="no-space"),
    pytest.param(b'data: {"a":1}\n\n\ndata: {"b":2}\n\n', id="a-stray-lf"),
    pytest.param(b'data: {"a":1}\r\n\r\ndata: {"b":2}\n\n', id="crlf"),
    pytest.param(b'data: {"a":1}\n\ndata: {"error":{"code":500,"message":"x"}}\n\n', id="engine-error"),
    pytest.param(b'data: {"a":1}\n\nevent: x\n\n', id="no-data-last"),
]


@pytest.mark.parametrize("read", PLAIN_READS + OTHER_READS)
def test_the_fast_way_gives_what_the_general_way_gives(read: bytes) -> None:
    reference = GeneralOnly()
    expected = shape(reference.feed(read))
    parsers = [SseParser(), SseParser(scan=False)]
    for parser in parsers:
        assert shape(parser.feed(read)) == expected
    after = [b'data: {"n":1}\n\ndata: {"m"', b":2}\n\n", b'data: {"o":3}\n\n']  # and they all read on alike
    for more in after:
        expected = shape(reference.feed(more))
        assert all(shape(parser.feed(more)) == expected for parser in parsers)


@pytest.mark.parametrize("read", PLAIN_READS)
def test_a_read_of_whole_plain_events_takes_the_fast_way(read: bytes) -> None:
    for scan in (True, False):
        parser = Watched(scan=scan)
        events = parser.feed(read)
        assert parser.fast == [True]
        assert [type(e) for e in events] == [Chunks] + ([Done] if read.endswith(b"data: [DONE]\n\n") else [])
    for before in (b'data: {"z"', b'data: {"z":0}\r'):  # something held from before: the general way
        parser, reference = Watched(), GeneralOnly()
        assert shape(parser.feed(before)) == shape(reference.feed(before))
        assert shape(parser.feed(read)) == shape(reference.feed(read))
        assert parser.fast == []  # the fast way was not even tried


def test_without_the_c_scan_the_fast_way_holds_no_facts() -> None:
    read = (RECORDINGS / "vllm/0.32.0/chat_stream_usage.sse").read_bytes()
    chunks = SseParser(scan=False).feed(read)[0]
    assert isinstance(chunks, Chunks) and chunks.facts is None and chunks.respell is None


def test_a_plain_reads_facts_are_what_its_payloads_say_and_the_c_scans_where_it_is_built() -> None:
    """The facts the check works from, as the Python reference works them out of the typed decode (run
    everywhere), are what the payloads say; where the C scan was built (``test_layers`` holds that to the
    compiler) the parser hands on exactly those, with model positions the Python respell takes too, and
    where it was not, none."""
    read = (RECORDINGS / "vllm/0.32.0/chat_stream_usage.sse").read_bytes()
    events = SseParser().feed(read)
    assert shape(events) == shape(SseParser(scan=False).feed(read))
    chunks = events[0]
    assert isinstance(chunks, Chunks)
    payloads = chunks.payload_list()
    reference = facts_of([_decode_head(p) for p in payloads], chunks.sse)
    count, model, _keys, top_index, text_count, first_text, _objects = reference
    assert count == len(payloads) == read.count(b"data: {")
    assert model == b'"tiny-llama"' and top_index == -1
    texts = [i for i, payload in enumerate(payloads) if b'"content":"' in payload and b'"content":""' not in payload]
    assert (text_count, first_text) == (len(texts), texts[0])
    at = [found.start() + 8 for found in re.finditer(rb'"model":"tiny-llama"', chunks.sse)]
    assert len(at) == count
    renamed = respell(chunks.sse, array.array("I", at).tobytes(), model, b'"other"')
    assert renamed == chunks.sse.replace(b'"model":"tiny-llama"', b'"model":"other"')
    if scan_run is None:
        assert chunks.facts is None and chunks.respell is None
    else:
        facts = chunks.facts
        assert msgspec.structs.astuple(facts)[:7] == reference and array.array("I", facts.positions).tolist() == at
        assert chunks.respell(chunks.sse, facts.positions, model, b'"other"') == renamed


def test_a_read_the_c_scan_will_not_vouch_for_is_parsed_the_general_way() -> None:
    read = b'data: {"model":"m","choices":[]}\n\ndata: {"error":{"code":500,"message":"x"}}\n\n'
    events = SseParser().feed(read)
    assert shape(events) == shape(GeneralOnly().feed(read)) == shape(SseParser(scan=False).feed(read))
    assert all(e.facts is None for e in events if isinstance(e, Chunks))  # an error event: the decode answers
