"""Incremental Server-Sent Events parser for engine streams.

Bytes arrive cut anywhere (inside a line, inside a UTF-8 character); events
end at a blank line. Each ``data:`` payload is kept as raw bytes for the
relay and decoded once, into the relay's typed structs
(``relay_check.decode_head``); a payload those refuse is decoded into a dict
instead, which gives every error of a payload that is no JSON object, and
the stages' answer for the rest. ``data: [DONE]`` ends the stream; a payload
holding ``error`` (and no ``choices``) is the engine giving up mid-stream;
comment lines (``:`` keep-alives) are passed on as comments.

The parser is linear in the bytes it reads: an event that spans many reads
is kept as a list of pieces, only the new bytes are searched for its end,
and an event that grows past ``max_event`` bytes is refused (``EdgeError``)
instead of being buffered without limit.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
from msgspec import UNSET

from capyctl.domain.errors import EdgeError
from capyctl.domain.relay_check import Undecoded, decode_head, decode_heads, scan_run
from capyctl.domain.streams import Chunk, Comment, Done, EngineFailure, Run, StreamEvent

_decode = msgspec.json.Decoder(dict[str, Any]).decode
_DONE = b"[DONE]"
DEFAULT_MAX_EVENT = 4 * 1024 * 1024


def _blank(buffer: bytes, start: int) -> int:
    """``buffer.find(b"\\n\\n", start)``, in a fraction of its time: a one-byte search is a memchr,
    a two-byte one a scan byte by byte, and an event's first LF is most often its end."""
    last = len(buffer) - 1
    end = buffer.find(b"\n", start)
    while end != -1:
        if end == last:
            return -1
        if buffer[end + 1] == 10:  # 10: LF
            return end
        end = buffer.find(b"\n", end + 2)
    return -1


def _payload(block: bytes) -> bytes | None:
    data: list[bytes] = []
    for line in block.split(b"\n"):
        if line.startswith(b"data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(data) if data else None


def parse_event(block: bytes, typed: bool = True) -> StreamEvent | None:
    """The event in ``block``; ``typed=False`` decodes every payload as a dict (the reference way)."""
    if block.startswith(b"data: ") and 10 not in block:  # the common case; 10 (LF) as an int is a memchr
        payload: bytes | None = block[6:]
    else:
        payload = _payload(block)
    if payload is None:
        return Comment(block) if block.startswith(b":") else None
    if payload == _DONE:
        return Done()
    if typed:
        try:
            head = decode_head(payload)
        except (msgspec.DecodeError, RecursionError):
            pass  # decoded below as a dict, in this same frame: its error (or dict) is the reference
        else:
            if head.error is UNSET or head.choices is not UNSET:
                return Chunk(payload, None, head)
    try:
        obj = _decode(payload)
    except msgspec.DecodeError as exc:
        raise EdgeError(f"the engine sent an event that is not a JSON object: {exc}") from exc
    except RecursionError as exc:
        raise EdgeError("the engine sent an event nested too deeply to decode") from exc
    if "error" in obj and "choices" not in obj:
        error = obj["error"] if isinstance(obj["error"], dict) else {"message": str(obj["error"])}
        return EngineFailure(payload, error)
    return Chunk(payload, obj)


MANY = object()  # SseParser.lone: the read is not one whole event alone


_DONE_EVENT = b"\n\ndata: [DONE]\n\n"  # [DONE] after other events (the blank line before it included)


def _run(body: bytes, max_event: int) -> Run | None:
    """``body`` (whole events, ending with their blank line) as one Run when it is plain events
    (``data: {...}``, one line each, one space after the colon, nothing else) whose payloads all decode
    into typed heads; None for anything else, which the parser then reads event by event (and whose
    errors are that way's)."""
    if len(body) > max_event or not body.startswith(b"data: {") or not body.endswith(b"\n\n"):
        return None
    if scan_run is not None and (facts := scan_run(body)) is not None:  # read in C: no heads decoded
        return Run(body, Undecoded(body, facts[0]), facts)
    payloads = body[6:-2].split(b"\n\ndata: ")
    count = len(payloads)
    if count == 1:  # one event alone is cheaper as a Chunk
        return None
    # Each payload must be one line (no LF of its own): a search of the payloads joined, then one decode
    # of them a line each, each line as decode_head would. (Counting the separators and the LFs, then
    # replacing the separators, took three passes more over the bytes.)
    if 10 in b"".join(payloads):  # 10: LF
        return None
    try:
        heads = decode_heads(b"\n".join(payloads))
    except (msgspec.DecodeError, RecursionError):
        return None
    if len(heads) != count:  # a blank payload is skipped by decode_lines: not plain
        return None
    for head in heads:
        if head.error is not UNSET and head.choices is UNSET:  # the engine's failure event
            return None
    return Run(body, heads)


class SseParser:
    __slots__ = ("_pending", "_size", "_cr", "_max", "_typed", "_runs")

    def __init__(self, max_event: int = DEFAULT_MAX_EVENT, typed: bool = True, runs: bool = False) -> None:
        self._pending: list[bytes] = []  # the start of an event whose end has not arrived
        self._size = 0
        self._cr = False  # the last read ended on a CR whose LF may be next
        self._max = max_event
        self._typed = typed  # False: every chunk decoded as a dict at once (the reference way, for benchmarks)
        self._runs = runs and typed  # plain events that came together are handed over as one Run

    def lone(self, data: bytes) -> StreamEvent | None | object:
        """What ``feed(data)`` yields, at once and without its generators, when ``data`` is one whole event
        on one line and nothing else, with nothing held from before: the event, or None where ``feed`` would
        yield nothing. ``MANY`` for any other read (two events, part of one, an event on several lines ...),
        which ``feed`` then takes. A stream at a model's pace comes a token a read: this is its every read,
        the first token's included."""
        end = len(data) - 2
        # its only LF is the first of the blank line that ends it (a one-byte search is a memchr; see _blank)
        if self._pending or self._cr or end < 0 or data.find(b"\n") != end or data[-1] != 10 or 13 in data:
            return MANY
        if end > self._max:
            self._check(end)
        return parse_event(data[:end], self._typed) if end else None

    def runs(self, data: bytes) -> list[StreamEvent] | object:
        """What ``feed(data)`` yields, at once and without its generators, when ``data`` is two or more whole
        plain events (the last one ended by its blank line, no CR), with nothing held from before, and they
        make a Run: ``[run]``, or ``[run, Done()]`` when the stream's ``[DONE]`` ends the read. ``MANY`` for
        any other read, which ``feed`` then takes. An engine at full speed sends reads like this."""
        # (a bytes search as find: ``in`` tries the needle as an int first, and makes and drops a TypeError)
        if (not self._runs or self._pending or self._cr or not data.endswith(b"\n\n") or 13 in data
                or data.find(b"\n\ndata: ") < 0):
            return MANY
        done = data.endswith(_DONE_EVENT)
        run = _run(data[:-14] if done else data, self._max)  # 14: data: [DONE] and its blank line
        if run is None:
            return MANY
        return [run, Done()] if done else [run]

    def feed(self, data: bytes) -> Iterator[StreamEvent]:
        if self._cr:
            data, self._cr = b"\r" + data, False
        if 13 in data:  # CRLF line ends (13: CR): normalise, holding back a CR whose LF has not arrived yet
            if data.endswith(b"\r"):
                data, self._cr = data[:-1], True
            data = data.replace(b"\r\n", b"\n")
        if not data:
            return
        if not self._pending:  # (runs only where two events may be: one alone is cheaper as a Chunk)
            yield from self._split_runs(data) if self._runs and data.find(b"\n\ndata: ") >= 0 else self._split(data)
            return
        # An event is under way: look for its end only around and after the seam.
        seam = b"\n" if self._pending[-1].endswith(b"\n") else b""
        end = (seam + data[:1]).find(b"\n\n") if seam else -1
        if end == -1:
            end = _blank(data, 0)
            cut = end
        else:
            cut = -1  # the blank line straddles the seam: the event ends with the pending bytes
        if end == -1:
            self._hold(data)
            return
        if cut == -1:
            block = b"".join(self._pending)[:-1]
            rest = data[1:]
        else:
            block = b"".join(self._pending) + data[:cut]
            rest = data[cut + 2 :]
        self._pending, self._size = [], 0
        self._check(len(block))
        event = parse_event(block.lstrip(b"\n"), self._typed) if block.strip(b"\n") else None
        if event is not None:
            yield event
        yield from self._split_runs(rest) if self._runs and rest.find(b"\n\ndata: ") >= 0 else self._split(rest)

    def _split_runs(self, buffer: bytes) -> Iterator[StreamEvent]:
        """The whole events in ``buffer`` as one Run (and [DONE]) when they are plain; else one by one."""
        end = buffer.rfind(b"\n\n") + 2
        if end > 1:
            body = buffer[:end] if end < len(buffer) else buffer
            done = body.endswith(_DONE_EVENT)
            run = _run(body[:-14] if done else body, self._max)  # 14: data: [DONE] and its blank line
            if run is not None:
                yield run
                if done:
                    yield Done()
                if end < len(buffer):
                    self._hold(buffer[end:])
                return
        yield from self._split(buffer)

    def _split(self, buffer: bytes) -> Iterator[StreamEvent]:
        start, last, typed = 0, len(buffer) - 1, self._typed
        while True:  # _blank(buffer, start), inline: the hot loop
            end = buffer.find(b"\n", start)
            while end != -1 and end != last and buffer[end + 1] != 10:
                end = buffer.find(b"\n", end + 2)
            if end == -1 or end == last:
                break
            if end - start > self._max:
                self._check(end - start)
            block = buffer[start:end]
            start = end + 2
            if block:
                event = parse_event(block if block[0] != 10 else block.lstrip(b"\n"), typed)  # 10: a stray LF
                if event is not None:
                    yield event
        if start < len(buffer):
            self._hold(buffer[start:] if start else buffer)

    def _hold(self, piece: bytes) -> None:
        self._pending.append(piece)
        self._size += len(piece)
        self._check(self._size)

    def _check(self, size: int) -> None:
        if size > self._max:
            self._pending, self._size = [], 0
            raise EdgeError(f"the engine sent an event larger than the limit of {self._max} bytes")

    def close(self) -> Iterator[StreamEvent]:
        """Flush a last event the engine did not end with a blank line."""
        block = b"".join(self._pending).strip(b"\n")
        self._pending, self._size = [], 0
        if block:
            event = parse_event(block, self._typed)
            if event is not None:
                yield event
