"""The HTTP/1.1 side of the test engines (``broken_engine``, ``standin_engine``): one connection, read
with a buffer of its own, requests framed by Content-Length only.

The buffer is the connection's (not the StreamReader's), so that what a
watcher reads while a request is answered (a pipelined request, or the end
of the stream) is kept for the next read.
"""

from __future__ import annotations

import asyncio
import contextlib

MAX_HEAD = 64 * 1024
READ = 64 * 1024


class PeerGone(Exception):
    """The client closed its connection."""


class Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_body: int) -> None:
        self.reader, self.writer = reader, writer
        self.buffer = bytearray()
        self.eof = False
        self.max_body = max_body

    async def fill(self) -> bool:
        """Read what has arrived into the buffer; False at end of file."""
        try:
            data = await self.reader.read(READ)
        except (ConnectionError, OSError):
            data = b""
        if not data:
            self.eof = True
            return False
        self.buffer += data
        return True

    async def until_eof(self) -> None:
        while await self.fill():
            pass

    async def read_message(self) -> tuple[str, str, dict[str, str], bytes] | str | None:
        """(method, target, headers, body) of the next request; None when the peer closed or sent something
        unreadable; ``"chunked"`` for a body sent with Transfer-Encoding (CapyCTL never sends one)."""
        while (end := self.buffer.find(b"\r\n\r\n")) < 0:
            if len(self.buffer) > MAX_HEAD or not await self.fill():
                return None
        lines = bytes(self.buffer[:end]).decode("latin-1").split("\r\n")
        del self.buffer[: end + 4]
        parts = lines[0].split(" ")
        if len(parts) != 3:
            return None
        headers = {}
        for line in lines[1:]:
            key, _, value = line.partition(":")
            headers[key.strip().lower()] = value.strip()
        if "transfer-encoding" in headers:
            return "chunked"
        try:
            length = int(headers.get("content-length", "0") or 0)
        except ValueError:
            return None
        if not 0 <= length <= self.max_body:
            return None
        while len(self.buffer) < length:
            if not await self.fill():
                return None
        body = bytes(self.buffer[:length])
        del self.buffer[:length]
        return parts[0], parts[1], headers, body

    async def write(self, data: bytes) -> None:
        if self.eof or self.writer.is_closing():
            raise PeerGone()
        self.writer.write(data)
        try:
            await self.writer.drain()
        except (ConnectionError, OSError) as exc:
            raise PeerGone() from exc

    async def close(self) -> None:
        self.writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self.writer.wait_closed()
