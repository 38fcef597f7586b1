"""Incremental Server-Sent Events parser for engine streams.

Bytes arrive cut anywhere (inside a line, inside a UTF-8 character); events
end at a blank line. Each ``data:`` payload is decoded once into a dict and
kept as raw bytes for the relay. ``data: [DONE]`` ends the stream; a payload
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

from capyctl.domain.errors import EdgeError
from capyctl.domain.streams import Chunk, Comment, Done, EngineFailure, StreamEvent

_decode = msgspec.json.Decoder(dict[str, Any]).decode
_DONE = b"[DONE]"
DEFAULT_MAX_EVENT = 4 * 1024 * 1024


def _payload(block: bytes) -> bytes | None:
    if block.startswith(b"data: ") and b"\n" not in block:  # the common case
        return block[6:]
    data: list[bytes] = []
    for line in block.split(b"\n"):
        if line.startswith(b"data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(data) if data else None


def parse_event(block: bytes) -> StreamEvent | None:
    payload = _payload(block)
    if payload is None:
        return Comment(block) if block.startswith(b":") else None
    if payload == _DONE:
        return Done()
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
    __slots__ = ("_pending", "_size", "_cr", "_max")

    def __init__(self, max_event: int = DEFAULT_MAX_EVENT) -> None:
        self._pending: list[bytes] = []  # the start of an event whose end has not arrived
        self._size = 0
        self._cr = False  # the last read ended on a CR whose LF may be next
        self._max = max_event

    def feed(self, data: bytes) -> Iterator[StreamEvent]:
        if self._cr:
            data, self._cr = b"\r" + data, False
        if b"\r" in data:  # CRLF line ends: normalise, holding back a CR whose LF has not arrived yet
            if data.endswith(b"\r"):
                data, self._cr = data[:-1], True
            data = data.replace(b"\r\n", b"\n")
        if not data:
            return
        if not self._pending:
            yield from self._split(data)
            return
        # An event is under way: look for its end only around and after the seam.
        seam = b"\n" if self._pending[-1].endswith(b"\n") else b""
        end = (seam + data[:1]).find(b"\n\n") if seam else -1
        if end == -1:
            end = data.find(b"\n\n")
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
        event = parse_event(block.lstrip(b"\n")) if block.strip(b"\n") else None
        if event is not None:
            yield event
        yield from self._split(rest)

    def _split(self, buffer: bytes) -> Iterator[StreamEvent]:
        start = 0
        while (end := buffer.find(b"\n\n", start)) != -1:
            if end - start > self._max:
                self._check(end - start)
            block = buffer[start:end]
            start = end + 2
            if block:
                event = parse_event(block if block[0] != 10 else block.lstrip(b"\n"))  # 10: a stray LF
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
            event = parse_event(block)
            if event is not None:
                yield event
