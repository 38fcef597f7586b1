"""The server's side of a host's ingress: its connection read and parsed, request by request (``Caller``).

httptools (llhttp) parses in its strict mode, each read fed to it once. A
request waits in ``Caller.ready`` once whole and not refused, in order; the
first refusal (the parser's, a head or body too late, or the ingress's own
check of a head) ends the parsing, and is answered after the requests
before it. ``Request.wire`` is what an engine gets: rebuilt from the parsed
parts, never the bytes received. See ``ingress`` for what is refused, and why.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import enum
from collections.abc import Callable
from typing import NamedTuple

import httptools
import msgspec

GATE = b"x-capyctl-gate"
MAX_HEAD = 64 << 10  # bytes of a request's head (give or take one read)
IDLE_TIMEOUT = 60.0  # seconds a kept-alive connection from the server may wait for its next request
_READ = 64 << 10  # bytes asked of the server's connection per read


class Refusal(NamedTuple):
    status: int
    code: str
    message: str


GATE_REFUSED = Refusal(403, "gate_refused", "no open gate for this key: the launch it named is over")


class Request:
    """One request as the parser gave it; it goes to an engine only once whole and not refused."""

    def __init__(self) -> None:
        self.method = b""
        self.target = b""
        self.version = ""
        self.headers: list[tuple[bytes, bytes]] = []  # names as sent, values without their surrounding blanks
        self.body: list[bytes] = []
        self.keep_alive = False

    def header(self, name: bytes) -> list[bytes]:
        return [value for key, value in self.headers if key.lower() == name]

    def gate(self) -> str | None:
        keys = self.header(GATE)
        return keys[0].decode("latin-1") if len(keys) == 1 else None  # two keys name no one launch

    def wire(self) -> bytes:
        """What the engine gets: rebuilt from the parsed parts, less the gate, each line ending CRLF."""
        lines = [b"%s %s HTTP/%s" % (self.method, self.target, self.version.encode())]
        lines += [name + b": " + value for name, value in self.headers if name.lower() != GATE]
        return b"\r\n".join(lines) + b"\r\n\r\n" + b"".join(self.body)


class _Phase(enum.Enum):
    IDLE = "idle"  # between requests
    HEAD = "head"  # a request begun, its head not whole
    BODY = "body"  # its head whole, its body not


class Caller:
    """The server's connection as httptools parses it, each read fed once: requests read whole wait in
    ``ready``, in order; the first refusal ends the parsing, and is answered after the requests before it."""

    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        check: Callable[[Request], Refusal | None],
        header_timeout: float,
        body_timeout: float,
    ) -> None:
        self.reader, self.writer = reader, writer
        self._check = check
        self._header_timeout, self._body_timeout = header_timeout, body_timeout
        self._parser = httptools.HttpRequestParser(self)  # strict: no set_dangerous_leniencies
        self._loop = asyncio.get_running_loop()
        self.ready: collections.deque[Request] = collections.deque()
        self.refusal: Refusal | None = None
        self._phase, self._since = _Phase.IDLE, self._loop.time()  # the phase, and when it began
        self._head_size = 0  # bytes fed since the last head was whole
        self._request = Request()

    async def next_request(self) -> Request | None:
        """The next request read whole; None once the connection is done with (a refusal or a timeout
        answered, the server gone, or idle too long)."""
        waited = self._loop.time()
        while not self.ready:
            if self.refusal is not None:
                await answer(self.writer, *self.refusal)
                return None
            deadline, late = self._deadline(waited)
            try:
                async with asyncio.timeout_at(deadline):
                    data = await self.reader.read(_READ)
            except TimeoutError:
                if late is not None:
                    await answer(self.writer, *late)
                return None
            if not data:
                return None  # the server closed its connection, mid-request too: nobody to answer
            self.feed(data)
        return self.ready.popleft()

    def _deadline(self, waited: float) -> tuple[float, Refusal | None]:
        """When the wait for more ends, and what is answered then (nothing between requests). A request begun
        while the one before it was answered has its time counted from when it is waited for."""
        if self._phase is _Phase.IDLE:
            return waited + IDLE_TIMEOUT, None
        part, seconds = ("head", self._header_timeout) if self._phase is _Phase.HEAD else ("body", self._body_timeout)
        late = Refusal(408, "request_timeout", f"the request's {part} did not arrive within {seconds:g} s")
        return max(waited, self._since) + seconds, late

    async def watch(self) -> None:
        """While an answer goes out: reads on, parsing what comes, and returns once the server's connection is
        gone. Once a request waits whole (or a refusal ended the parsing) nothing more is read: the transport
        still takes in EOF or a reset, and so closes, until its own bounded buffer is full."""
        try:
            while not self.ready and self.refusal is None:
                data = await self.reader.read(_READ)
                if not data:
                    return
                self.feed(data)
            await self.writer.wait_closed()
        except OSError:
            return  # a reset, or a broken TLS record: gone as well

    def feed(self, data: bytes) -> None:
        if self.refusal is not None:
            return
        if self._phase is not _Phase.BODY:
            self._head_size += len(data)
            if self._head_size > MAX_HEAD:
                self._refuse(Refusal(400, "invalid_request", f"the request's head is over {MAX_HEAD} bytes"))
                return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(Refusal(400, "invalid_request", "the ingress does not upgrade connections"))
        except httptools.HttpParserError as exc:
            self._refuse(Refusal(400, "invalid_request", f"the request is not valid HTTP/1.1: {exc}"))

    def _refuse(self, refusal: Refusal) -> None:
        if self.refusal is None:
            self.refusal = refusal

    # httptools
    def on_message_begin(self) -> None:
        self._request = Request()
        self._phase, self._since = _Phase.HEAD, self._loop.time()

    def on_url(self, url: bytes) -> None:
        self._request.target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._request.headers.append((name, value.rstrip(b" \t")))  # llhttp keeps a value's trailing blanks

    def on_headers_complete(self) -> None:
        request, parser = self._request, self._parser
        request.method, request.version = parser.get_method(), parser.get_http_version()
        request.keep_alive = parser.should_keep_alive()
        self._phase, self._since, self._head_size = _Phase.BODY, self._loop.time(), 0
        refusal = (
            Refusal(400, "invalid_request", "the ingress does not upgrade connections")
            if parser.should_upgrade()
            else self._check(request)
        )
        if refusal is not None:
            self._refuse(refusal)

    def on_body(self, body: bytes) -> None:
        self._request.body.append(body)

    def on_message_complete(self) -> None:
        self._phase, self._since = _Phase.IDLE, self._loop.time()
        if self.refusal is None:
            self.ready.append(self._request)


async def answer(writer: asyncio.StreamWriter, status: int, code: str, message: str) -> None:
    """The ingress's own answer: no engine saw the request, which ``X-CapyCTL-Not-Forwarded`` says (the server
    may then send it to another instance)."""
    body = msgspec.json.encode(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error" if status < 500 else "server_error",
                "code": code,
            }
        }
    )
    writer.write(
        b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close"
        b"\r\nX-CapyCTL-Not-Forwarded: 1\r\n\r\n" % (status, _REASONS.get(status, b"Error"), len(body)) + body
    )
    with contextlib.suppress(ConnectionError):  # the server went away: the connection closes all the same
        await writer.drain()


_REASONS = {
    400: b"Bad Request",
    403: b"Forbidden",
    404: b"Not Found",
    408: b"Request Timeout",
    411: b"Length Required",
    413: b"Content Too Large",
    502: b"Bad Gateway",
}
