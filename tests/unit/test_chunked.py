"""An engine's chunked answer unframed a read at a time (``_chunked.dechunk`` in ``_Response``), against
httptools unframing the same bytes: the same body, the same end, the same errors refused."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import capyctl.adapters.engines._wire as wire
from capyctl.adapters.engines._wire import _Response

# Built where a C compiler was found at install; without it, httptools unframes every body (the reference
# these tests hold it to), and test_layers checks it is built wherever gcc is.
_chunked = pytest.importorskip("capyctl._speedups.chunked", reason="dechunk was not built (no C compiler)")
DATA, DONE, SIZE, TRAILER, dechunk = _chunked.DATA, _chunked.DONE, _chunked.SIZE, _chunked.TRAILER, _chunked.dechunk

HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
        b"transfer-encoding: chunked\r\n\r\n")


def chunked(pieces: list[bytes], extension: bytes = b"", trailers: bytes = b"") -> bytes:
    return b"".join(b"%x%b\r\n%b\r\n" % (len(p), extension, p) for p in pieces) + b"0\r\n" + trailers + b"\r\n"


class _Transport:
    def __init__(self) -> None:
        self.closed = False

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


def received(reads: list[bytes], unframe: bool, monkeypatch: pytest.MonkeyPatch) -> _Response:
    with monkeypatch.context() as patch:
        if not unframe:
            patch.setattr(wire, "_dechunk", None)
        conn = _Response()
        conn.connection_made(_Transport())  # type: ignore[arg-type]
        for data in reads:
            conn.data_received(data)
    return conn


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in zip(points, points[1:]) if b > a]


def outcome(conn: _Response) -> tuple:
    return b"".join(conn.body), conn.complete, conn.keep_alive, conn.reusable(), repr(conn.lost)


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(st.binary(min_size=1, max_size=300), max_size=12),
       cuts=st.lists(st.integers(min_value=0), max_size=8),
       extension=st.sampled_from([b"", b";x=1", b";name"]),
       trailers=st.sampled_from([b"", b"x-trailer: 1\r\n"]))
def test_unframed_like_httptools_at_any_read_boundaries(pieces: list[bytes], cuts: list[int], extension: bytes,
                                                         trailers: bytes) -> None:
    data = HEAD + chunked(pieces, extension, trailers)
    reads = split(data, cuts)
    monkeypatch = pytest.MonkeyPatch()
    ours, theirs = received(reads, True, monkeypatch), received(reads, False, monkeypatch)
    assert outcome(ours) == outcome(theirs)
    assert b"".join(ours.body) == b"".join(pieces)
    assert ours.complete and ours.reusable()
    # whether the unframing was taken: only where the head ended in the first read
    assert ours.unframing == (reads[0].find(b"\r\n\r\n") >= 0)


def test_a_stream_read_by_read_gives_one_body_piece_a_read(monkeypatch: pytest.MonkeyPatch) -> None:
    events = [b"data: {\"n\": %d}\n\n" % i for i in range(40)]
    reads = [HEAD] + [chunked(events[i:i + 10])[:-5] for i in range(0, 40, 10)] + [b"0\r\n\r\n"]
    conn = _Response()
    conn.connection_made(_Transport())  # type: ignore[arg-type]
    bodies = []
    for data in reads:
        conn.data_received(data)
        bodies.append(conn.take())
    assert bodies == [b""] + [b"".join(events[i:i + 10]) for i in range(0, 40, 10)] + [b""]
    assert conn.unframing and conn.complete and conn.reusable()


def test_the_connection_serves_its_next_answer_with_a_fresh_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    conn = received([HEAD + chunked([b"data: a\n\n"])], True, monkeypatch)
    assert conn.unframing and conn.complete
    first_parser = conn.parser
    conn.reset()
    assert conn.parser is not first_parser and not conn.unframing and not conn.complete
    conn.data_received(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\ncontent-length: 9\r\n\r\n"
                       b"{\"x\": 1}\n")
    assert (conn.status, conn.take(), conn.complete, conn.unframing) == (400, b"{\"x\": 1}\n", True, False)


@pytest.mark.parametrize("body, says", [
    (b"zz\r\nab\r\n0\r\n\r\n", "not hexadecimal"),
    (b"\r\n", "not hexadecimal"),
    (b"2\r\nabXY0\r\n\r\n", "no CRLF after a chunk's data"),
    (b"2\nab\r\n0\r\n\r\n", "not ended by CRLF"),
    (b"1234567890abcdef0\r\n", "too large"),
    (b"2" + b" " * 5000, "too long"),
    (b"2 ;x\r\nab\r\n0\r\n\r\n", "not hexadecimal"),
    (b"3;\x00\r\nabc\r\n0\r\n\r\n", "chunk extension"),
    (b"3;\r\nabc\r\n0\r\n\r\n", "chunk extension"),
    (b"3;a=b c\r\nabc\r\n0\r\n\r\n", "chunk extension"),
    (b'3;a="x\r\nabc\r\n0\r\n\r\n', "chunk extension"),
    (b"0\r\n:\r\n\r\n", "trailer field"),
    (b"0\r\nx-a: \x01\r\n\r\n", "trailer field"),
])
def test_a_broken_framing_breaks_the_connection_as_httptools_would(body: bytes, says: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    ours = received([HEAD, body], True, monkeypatch)
    theirs = received([HEAD, body], False, monkeypatch)
    assert says in str(ours.lost)
    assert not ours.complete and not ours.reusable()
    assert not theirs.complete  # httptools refuses it too, or waits for a framing that never comes


@pytest.mark.parametrize("extension, trailer", [(b';a="q \\" x"', b""), (b";a;b=c;d=", b"x-t: a\tb c\r\n")])
def test_valid_extensions_and_trailers_are_skipped(extension: bytes, trailer: bytes,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    body = chunked([b"data: a\n\n", b"data: b\n\n"], extension, trailer)
    for unframe in (True, False):  # (httptools takes them too)
        conn = received([HEAD, body], unframe, monkeypatch)
        assert conn.lost is None and conn.complete and b"".join(conn.body) == b"data: a\n\ndata: b\n\n"


@pytest.mark.parametrize("length, refused", [(4096, False), (4097, True)])
def test_a_long_line_is_refused_or_not_wherever_the_read_ends(length: int, refused: bool) -> None:
    """A size line of ``length`` bytes (a size and an extension) is refused for its length alone: the same
    answer whole, and cut before its CR, at its CR, or before its LF."""
    line = b"5;" + b"a" * (length - 2) + b"\r\n"
    answers = []
    for cut in (None, length, length + 1, length - 1):
        reads = [line + b"hello\r\n"] if cut is None else [line[:cut], line[cut:] + b"hello\r\n"]
        state, left, pending, payload, error = SIZE, 0, b"", b"", None
        try:
            for read in reads:
                got, state, left, used = dechunk(pending + read, state, left)
                pending, payload = (pending + read)[used:], payload + got
        except ValueError as exc:
            error = str(exc)
        answers.append((payload, error))
    assert len(set(answers)) == 1
    assert (answers[0][1] is not None) == refused and answers[0][0] == (b"" if refused else b"hello")


def test_nothing_after_a_broken_framing_is_taken_for_the_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found by the fuzzer: a read that breaks the framing, then a read of well-framed chunks and the end.
    httptools takes nothing after the break; neither may the unframing (it once took the second read as a
    whole answer)."""
    reads = [HEAD + b"2\r\nabXY", b"3\r\nxyz\r\n0\r\n\r\n"]
    for unframe in (True, False):
        conn = received(reads, unframe, monkeypatch)
        assert conn.lost is not None and not conn.complete and b"xyz" not in b"".join(conn.body)


def test_bytes_after_the_answer_keep_the_connection_from_reuse(monkeypatch: pytest.MonkeyPatch) -> None:
    conn = received([HEAD + chunked([b"data: a\n\n"]) + b"HTTP/1.1 200"], True, monkeypatch)
    assert conn.complete and b"".join(conn.body) == b"data: a\n\n"
    assert not conn.reusable()
    idle = received([HEAD + chunked([b"data: a\n\n"]), b"junk"], True, monkeypatch)
    assert idle.transport is not None and idle.transport.is_closing()  # an idle connection that speaks is dropped


def test_dechunk_keeps_its_place_between_reads() -> None:
    assert dechunk(b"5\r\nhel", SIZE, 0) == (b"hel", DATA, 2, 6)
    assert dechunk(b"lo\r", DATA, 2) == (b"lo", 2, 1, 3)  # one byte of the CRLF still due
    assert dechunk(b"\n1", 2, 1) == (b"", SIZE, 0, 1)  # a size line begun: left for the next read
    assert dechunk(b"0\r\nx: y\r\n", SIZE, 0) == (b"", TRAILER, 0, 9)
    assert dechunk(b"\r\nrest", TRAILER, 0) == (b"", DONE, 0, 2)
    with pytest.raises(ValueError):
        dechunk(b"", 9, 0)


def test_random_streams_against_httptools(monkeypatch: pytest.MonkeyPatch) -> None:
    """Larger streams than the property test's, split at every kind of place."""
    rng = random.Random(12)
    for _ in range(50):
        pieces = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 5000))) for _ in range(rng.randrange(1, 40))]
        data = HEAD + chunked(pieces)
        reads = split(data, [len(HEAD) + rng.randrange(len(data) - len(HEAD)) for _ in range(rng.randrange(1, 30))])
        ours, theirs = received(reads, True, monkeypatch), received(reads, False, monkeypatch)
        assert outcome(ours) == outcome(theirs)
        assert ours.unframing
