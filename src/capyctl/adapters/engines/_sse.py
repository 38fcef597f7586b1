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
from capyctl.domain.relay_check import decode_head
from capyctl.domain.streams import Chunk, Comment, Done, EngineFailure, StreamEvent

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


class SseParser:
    """``feed`` each read as it comes; it yields the events that read completed, in order. ``close`` flushes
    a last event the engine did not end with a blank line."""

    __slots__ = ("_pending", "_size", "_cr", "_max", "_typed")

    def __init__(self, max_event: int = DEFAULT_MAX_EVENT, typed: bool = True) -> None:
        self._pending: list[bytes] = []  # the start of an event whose end has not arrived
        self._size = 0
        self._cr = False  # the last read ended on a CR whose LF may be next
        self._max = max_event
        self._typed = typed  # False: every chunk decoded as a dict (the reference way, for tests)

    def feed(self, data: bytes) -> Iterator[StreamEvent]:
        if self._cr:
            data, self._cr = b"\r" + data, False
        if 13 in data:  # CRLF line ends (13: CR): normalise, holding back a CR whose LF has not arrived yet
            if data.endswith(b"\r"):
                data, self._cr = data[:-1], True
            data = data.replace(b"\r\n", b"\n")
        if not data:
            return
        if self._pending:  # an event is under way: look for its end only around and after the seam
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
                data = data[1:]
            else:
                block = b"".join(self._pending) + data[:cut]
                data = data[cut + 2 :]
            self._pending, self._size = [], 0
            self._check(len(block))
            event = parse_event(block.lstrip(b"\n"), self._typed) if block.strip(b"\n") else None
            if event is not None:
                yield event
        yield from self._split(data)

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
