"""A host's ingress (``start host --ingress-listen``, 0.0.0.0:8444 by default): the only door to its engines.

HTTPS with the host's own certificate (the server checks it is the host it
means to reach, by its name). Engines listen on the host's loopback only;
the ingress forwards to one of them only:

- an inference path (``/v1/chat/completions``, ``/v1/completions``,
  ``/v1/systemone``), anything else 404 ``not_found``;
- with the gate key of a launch in ``X-CapyCTL-Gate``, a key the server gave
  over the control link (``open_gate``) and has not closed: 403
  ``gate_refused`` otherwise;
- a body of at most 8 MiB sent with ``Content-Length`` (413 ``too_large``
  at once, before the body is read; 411 without a length).

The request goes to the engine without the gate header, and the engine's
answer comes back byte for byte. Connections are kept alive on both sides
(the engine's answer is parsed only to find where it ends), so the server's
next request costs no TLS handshake and the engine's no connect. The moment
the server's connection goes away mid-answer, the engine's is closed: that
is how an engine on another machine learns its client left.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import socket
import ssl

import anyio
import httptools
import msgspec

from capyctl.domain.limits import HOST_MAX_BODY

log = logging.getLogger("capyctl.ingress")
PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/systemone"})
GATE = b"x-capyctl-gate"
MAX_BODY = HOST_MAX_BODY
MAX_HEAD = 64 << 10
HEAD_TIMEOUT = 10.0  # seconds from a request's first byte to the end of its head
IDLE_TIMEOUT = 60.0  # seconds a kept-alive connection from the server may wait for its next request
_IDLE_PER_ENGINE = 64  # kept-alive connections to one engine
_HIGH_WATER = 1 << 20  # bytes waiting for the server's connection past which the engine is read no more


class Ingress:
    def __init__(self, tls: ssl.SSLContext, max_body: int = MAX_BODY) -> None:
        self._tls = tls
        self._max_body = max_body
        self._gates: dict[str, int] = {}  # gate key -> the engine's port on this host's loopback
        self._idle: dict[int, list[_Engine]] = {}  # engine port -> its kept-alive connections

    def open_gate(self, key: str, port: int) -> None:
        if not key or not 0 < port < 65536:
            raise ValueError("a gate needs a key and an engine port")
        self._gates[key] = port

    def close_gate(self, key: str) -> None:
        port = self._gates.pop(key, None)
        if port is not None and port not in self._gates.values():  # the launch is over: so are its connections
            for engine in self._idle.pop(port, []):
                engine.close()

    async def serve(self, sock: socket.socket, stopping: anyio.Event) -> None:
        server = await asyncio.start_server(self._serve_one, sock=sock, ssl=self._tls, limit=MAX_HEAD,
                                            ssl_handshake_timeout=HEAD_TIMEOUT)
        async with server:
            await stopping.wait()

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # each event leaves as it comes: asyncio sets TCP_NODELAY only on sockets made with proto IPPROTO_TCP,
        # and a listening socket made with proto 0 accepts sockets of proto 0 (Nagle, then the delayed ACK,
        # held the event after the head some 40 ms)
        raw = writer.get_extra_info("socket")
        if raw is not None:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while await self._forward(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            pass  # the server went away: nothing to answer
        except Exception:  # a bug of the ingress: this request fails, the ingress goes on
            log.exception("ingress: a request failed")
        finally:
            writer.close()

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """One request forwarded and its answer relayed; True when the connection may carry the next."""
        try:  # a connection between two requests (or opened ahead of one) with nothing more just closes
            async with asyncio.timeout(IDLE_TIMEOUT):
                first = await reader.readexactly(1)
        except (asyncio.IncompleteReadError, TimeoutError):
            return False
        try:
            async with asyncio.timeout(HEAD_TIMEOUT):
                head = first + await reader.readuntil(b"\r\n\r\n")
        except (asyncio.LimitOverrunError, asyncio.IncompleteReadError, TimeoutError):
            await _answer(writer, 400, "invalid_request", "no complete request head")
            return False
        lines = head[:-4].split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            await _answer(writer, 400, "invalid_request", "not an HTTP/1.1 request line")
            return False
        method, target = parts[0], parts[1]
        headers: list[tuple[bytes, bytes]] = []
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip():
                await _answer(writer, 400, "invalid_request", "a header line is not `name: value`")
                return False
            headers.append((name.lower(), value.strip()))
        found = dict(headers)
        if target.split(b"?")[0].decode("latin-1") not in PATHS or method != b"POST":
            await _answer(writer, 404, "not_found", "the ingress forwards only POSTs to an engine's inference paths")
            return False
        port = self._gates.get(found.get(GATE, b"").decode("latin-1"))
        if port is None:
            await _answer(writer, 403, "gate_refused", "no open gate for this key: the launch it named is over")
            return False
        if b"transfer-encoding" in found or b"content-length" not in found:
            await _answer(writer, 411, "invalid_request", "the ingress takes a body sent with Content-Length")
            return False
        try:
            length = int(found[b"content-length"])
        except ValueError:
            length = -1
        if length < 0:
            await _answer(writer, 400, "invalid_request", "Content-Length is not a length")
            return False
        if length > self._max_body:
            await _answer(writer, 413, "too_large", f"request body is larger than the limit of {self._max_body} bytes")
            return False
        body = await reader.readexactly(length)
        kept = b"".join(name + b": " + value + b"\r\n" for name, value in headers if name != GATE)
        request = lines[0] + b"\r\n" + kept + b"\r\n" + body
        for fresh in (False, True):  # a kept-alive connection the engine closed meanwhile: once more, afresh
            engine = await self._send(port, request, writer.transport, fresh)
            if engine is None:
                await _answer(writer, 502, "engine_unavailable", "the engine behind this gate does not answer")
                return False
            try:
                outcome = await _relay(engine, writer, reader)
            except BaseException:
                engine.close()
                raise
            if outcome is not _Outcome.UNANSWERED or not engine.reused:
                break
        if outcome is not _Outcome.COMPLETE or not engine.reusable():
            engine.close()  # at once, also when the server's connection went first
            return False
        idle = self._idle.setdefault(port, [])
        if len(idle) < _IDLE_PER_ENGINE and port in self._gates.values():
            idle.append(engine)
        else:
            engine.close()
        return found.get(b"connection", b"").lower() != b"close"

    async def _send(self, port: int, request: bytes, client: asyncio.WriteTransport, fresh: bool
                    ) -> _Engine | None:
        """``request`` written to the engine on ``port``: on a kept-alive connection when one stands idle (and
        not ``fresh``), else a new one; None when the engine cannot be reached."""
        idle = self._idle.get(port, []) if not fresh else []
        while idle:
            engine = idle.pop()
            if engine.open():
                engine.reused = True
                engine.start(client, request)
                return engine
        loop = asyncio.get_running_loop()
        try:
            _, engine = await loop.create_connection(_Engine, "127.0.0.1", port)
        except OSError:
            return None
        engine.start(client, request)
        return engine


class _Engine(asyncio.Protocol):
    """A connection to an engine, kept alive between requests. While it answers one, each read is written to
    the server's connection in this callback, as it arrives (no task wakes per read), and parsed only to
    find the answer's end; reading pauses while the server's side is full."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self._client: asyncio.WriteTransport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self.ended: asyncio.Future[None] | None = None  # done once the answer is whole, or the connection lost
        self.full: asyncio.Future[None] | None = None  # set while reading waits for the client to drain
        self.complete = False
        self.answered = False  # a byte of the answer came
        self.reused = False  # kept alive from an earlier request
        self._keep_alive = False

    def start(self, client: asyncio.WriteTransport, request: bytes) -> None:
        self._client, self.complete, self.answered = client, False, False
        self.ended = asyncio.get_running_loop().create_future()
        assert self.transport is not None
        self.transport.write(request)

    def open(self) -> bool:
        return self.transport is not None and not self.transport.is_closing()

    def reusable(self) -> bool:
        return self.complete and self._keep_alive and self.open()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        client = self._client
        if client is None:  # nothing asked: an engine talking out of turn is not relayed
            self.close()
            return
        client.write(data)
        self.answered = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            self._keep_alive = False  # relayed as it came; the connection is not used again
        if client.get_write_buffer_size() > _HIGH_WATER and self.transport is not None:
            self.transport.pause_reading()
            _settle(self.full)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        _settle(self.ended)
        _settle(self.full)

    # httptools
    def on_headers_complete(self) -> None:
        self._keep_alive = self._parser.should_keep_alive()

    def on_message_complete(self) -> None:
        self.complete, self._client = True, None
        _settle(self.ended)


def _settle(future: asyncio.Future[None] | None) -> None:
    if future is not None and not future.done():
        future.set_result(None)


class _Outcome(enum.Enum):
    COMPLETE = "complete"  # the engine's answer is whole
    CLIENT_GONE = "client_gone"  # the server's connection went first
    BROKEN = "broken"  # the engine's connection broke mid-answer
    UNANSWERED = "unanswered"  # the engine's connection closed before any byte of an answer


async def _relay(engine: _Engine, client: asyncio.StreamWriter, client_reader: asyncio.StreamReader) -> _Outcome:
    """Until the engine's answer is whole, or the engine's or the server's connection is gone; the server's
    side drained whenever it is full."""
    assert engine.ended is not None
    ended = engine.ended
    gone = asyncio.ensure_future(client_reader.read(1))  # the server sends nothing mid-answer: EOF means it left
    loop = asyncio.get_running_loop()
    try:
        while not ended.done():
            engine.full = full = loop.create_future()
            await asyncio.wait({ended, gone, full}, return_when=asyncio.FIRST_COMPLETED)
            if gone.done():
                return _Outcome.CLIENT_GONE
            if full.done() and not ended.done() and engine.transport is not None:
                await client.drain()
                engine.transport.resume_reading()
        await client.drain()  # what the engine sent last leaves before anything else happens here
        if engine.complete:
            return _Outcome.COMPLETE
        return _Outcome.BROKEN if engine.answered else _Outcome.UNANSWERED
    finally:
        engine.full = None
        gone.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await gone


async def _answer(writer: asyncio.StreamWriter, status: int, code: str, message: str) -> None:
    body = msgspec.json.encode({"error": {"message": message, "type": "invalid_request_error"
                                          if status < 500 else "server_error", "code": code}})
    writer.write(b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close"
                 b"\r\n\r\n" % (status, _REASONS.get(status, b"Error"), len(body)) + body)
    with contextlib.suppress(ConnectionError):
        await writer.drain()


_REASONS = {400: b"Bad Request", 403: b"Forbidden", 404: b"Not Found", 411: b"Length Required",
            413: b"Content Too Large", 502: b"Bad Gateway"}
