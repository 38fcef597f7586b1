"""Incremental Server-Sent Events parser for engine streams.

Bytes arrive cut anywhere (inside a line, inside a UTF-8 character); events
end at a blank line. Each ``data:`` payload is decoded once into a dict and
kept as raw bytes for the relay. ``data: [DONE]`` ends the stream; a payload
holding ``error`` (and no ``choices``) is the engine giving up mid-stream;
comment lines (``:`` keep-alives) are passed on as comments.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec

from capyctl.domain.errors import BadEngineResponse
from capyctl.domain.streams import Chunk, Comment, Done, EngineFailure, StreamEvent

_decode = msgspec.json.Decoder(dict[str, Any]).decode
_DONE = b"[DONE]"


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
        raise BadEngineResponse(f"the engine sent an event that is not JSON: {exc}") from exc
    if "error" in obj and "choices" not in obj:
        error = obj["error"] if isinstance(obj["error"], dict) else {"message": str(obj["error"])}
        return EngineFailure(payload, error)
    return Chunk(payload, obj)


class SseParser:
    __slots__ = ("_buffer",)

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> Iterator[StreamEvent]:
        buffer = self._buffer + data if self._buffer else data
        if b"\r" in data or self._buffer.endswith(b"\r"):
            # CRLF line ends: normalise, holding back a CR whose LF has not arrived yet
            held = buffer.endswith(b"\r")
            buffer = buffer[:-1].replace(b"\r\n", b"\n") if held else buffer.replace(b"\r\n", b"\n")
            if held:
                self._buffer = b""
                yield from self._split(buffer)
                self._buffer += b"\r"
                return
        yield from self._split(buffer)

    def _split(self, buffer: bytes) -> Iterator[StreamEvent]:
        start = 0
        while (end := buffer.find(b"\n\n", start)) != -1:
            block = buffer[start:end]
            start = end + 2
            if block:
                event = parse_event(block.lstrip(b"\n"))
                if event is not None:
                    yield event
        self._buffer = buffer[start:]

    def close(self) -> Iterator[StreamEvent]:
        """Flush a last event the engine did not end with a blank line."""
        block, self._buffer = self._buffer.strip(b"\n"), b""
        if block:
            event = parse_event(block)
            if event is not None:
                yield event
