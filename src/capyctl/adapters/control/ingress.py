"""A host's ingress (``start host --ingress-listen``, 0.0.0.0:8444 by default): the only door to its engines.

HTTPS with the host's own certificate (the server checks it is the very
certificate the host holds now, not one signed for its name before), and
mutual: the only client that completes a handshake is the one whose
certificate the server sent over the control link (``trust_callers``). A host's
certificate, or none, fails the handshake in OpenSSL, before any byte of
HTTP is read (in TLS 1.3 such a client may have sent its request by then:
it gets no answer); until the server has said whom to trust, every
connection is closed unread.

Requests are parsed by httptools (llhttp) in its strict mode, each read fed
to it once: a request it refuses (a bare LF, a folded header line, a blank
before a colon, a length that is not digits or is given twice, a length
beside a ``Transfer-Encoding``, a head over 64 KiB ...) gets 400
``invalid_request``, with the parser's reason. Engines listen on the host's
loopback only; the ingress forwards to one of them only, decided on the
head before any byte of the body is read:

- a POST to an inference path (``/v1/chat/completions``, ``/v1/completions``,
  ``/v1/systemone``), anything else 404 ``not_found``;
- with the gate key of a launch in ``X-CapyCTL-Gate``, a key the server gave
  over the control link (``open_gate``) and has not closed: 403
  ``gate_refused`` otherwise;
- a body of at most 8 MiB sent with ``Content-Length`` (413 ``too_large``,
  411 without a length, a chunked body included);
- the head within ``header_timeout`` seconds of its first byte (10 s) and the
  body within ``body_timeout`` of the head's end (60 s), the server's own
  door's defaults: 408 ``request_timeout`` otherwise.

Each refusal closes the connection, and no engine sees a byte of a refused
or incomplete request: a request goes on only once it is whole, rebuilt from
what the parser gave (its request line, its headers less the gate, each line
ending CRLF, its body), never as the bytes received. The engine's answer
comes back byte for byte. Connections are kept alive on both sides (the
engine's answer is parsed only to find where it ends), so the server's next
request costs no TLS handshake and the engine's no connect.

While an answer goes out, the server's connection is still read: a request
pipelined behind it is parsed and answered after it, in order (once one waits
whole, reading stops until its turn), and the moment the server's connection
goes away mid-answer the engine's is closed: that is how an engine on another
machine learns its client left.

``serve`` ends when ``stopping`` is set or its task is cancelled: the
listener, every connection (mid-answer ones too) and the kept engine
connections are closed, and no task of the ingress runs on.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import socket
import ssl
from collections.abc import Callable
from typing import NamedTuple

import anyio
import httptools
import msgspec

from capyctl.adapters.pki import server_ssl_context
from capyctl.domain.limits import HOST_MAX_BODY, Limits

log = logging.getLogger("capyctl.ingress")
PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/systemone"})
GATE = b"x-capyctl-gate"
MAX_BODY = HOST_MAX_BODY
MAX_HEAD = 64 << 10  # bytes of a request's head (give or take one read)
HEADER_TIMEOUT = Limits().header_timeout  # the server's own door's (limits.client_header_timeout)
BODY_TIMEOUT = Limits().body_timeout  # the same (limits.client_body_timeout)
IDLE_TIMEOUT = 60.0  # seconds a kept-alive connection from the server may wait for its next request
_READ = 64 << 10  # bytes asked of the server's connection per read
_CLOSE_BOUND = 5.0  # seconds serve waits for its cancelled connections, which end at once unless a bug holds one
_IDLE_PER_ENGINE = 64  # kept-alive connections to one engine
_HIGH_WATER = 1 << 20  # bytes waiting for the server's connection past which the engine is read no more


class _Refusal(NamedTuple):
    status: int
    code: str
    message: str


_GATE_REFUSED = _Refusal(403, "gate_refused", "no open gate for this key: the launch it named is over")


class Ingress:
    def __init__(self, cert_pem: bytes, key_pem: bytes, max_body: int = MAX_BODY, *,
                 header_timeout: float = HEADER_TIMEOUT, body_timeout: float = BODY_TIMEOUT) -> None:
        self._cert_pem, self._key_pem = cert_pem, key_pem  # the host's own, shown to every caller
        self._tls: ssl.SSLContext | None = None  # none until the server says whom to trust
        self._max_body = max_body
        self._header_timeout, self._body_timeout = header_timeout, body_timeout
        self._gates: dict[str, int] = {}  # gate key -> the engine's port on this host's loopback
        self._idle: dict[int, list[_Engine]] = {}  # engine port -> its kept-alive connections
        self._connections: set[asyncio.Task[None]] = set()  # one task per connection from the server
        self._stopped = False

    def trust_callers(self, caller_pem: bytes) -> None:
        """From now on, only a client showing ``caller_pem`` (the server's, sent over the control link) completes
        a handshake; connections already up are left as they are (they proved the caller before)."""
        self._tls = server_ssl_context(self._cert_pem, self._key_pem, caller_pem, require_client=True)

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
        """Serves on ``sock`` until ``stopping`` is set or this task is cancelled; returns (or raises the
        cancellation) once every connection is closed and no task of the ingress is left."""
        server = await asyncio.start_server(self._serve_one, sock=sock, limit=MAX_HEAD)
        try:
            await stopping.wait()
        finally:
            server.close()
            self._stopped = True  # a connection accepted in the meantime is closed as it comes
            with anyio.CancelScope(shield=True):
                await self._close_all()

    async def _close_all(self) -> None:
        connections = set(self._connections)
        for task in connections:
            task.cancel()
        if connections:
            await asyncio.wait(connections, timeout=_CLOSE_BOUND)
        for engines in self._idle.values():
            for engine in engines:
                engine.close()
        self._idle.clear()

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if self._stopped or task is None:
            writer.transport.abort()
            return
        self._connections.add(task)
        try:
            await self._converse(reader, writer)
        except asyncio.CancelledError:  # the ingress stops (``_close_all``): the connection ends now, quietly
            writer.transport.abort()  # no TLS goodbye to wait for
            # not re-raised: asyncio 3.11's streams ask this task for its exception when it ends, and a
            # cancelled one answers with a traceback in the log
        finally:
            writer.close()
            self._connections.discard(task)

    async def _converse(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # each event leaves as it comes: asyncio sets TCP_NODELAY only on sockets made with proto IPPROTO_TCP,
        # and a listening socket made with proto 0 accepts sockets of proto 0 (Nagle, then the delayed ACK,
        # held the event after the head some 40 ms)
        raw = writer.get_extra_info("socket")
        if raw is not None:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        tls = self._tls  # the context of the moment: a later trust_callers affects later connections only
        if tls is None:
            return  # nobody to trust yet: nothing is read, nothing answered
        try:
            await writer.start_tls(tls, ssl_handshake_timeout=self._header_timeout)
        except OSError:  # not the server's certificate (or none), or too slow: nothing was read
            return
        caller = _Caller(reader, writer, self._refusal, self._header_timeout, self._body_timeout)
        try:
            while (request := await caller.next_request()) is not None and await self._forward(request, caller):
                pass
        except OSError:
            pass  # the server went away (a reset, a broken TLS record): nothing to answer
        except Exception:  # a bug of the ingress: this connection fails, the ingress goes on
            log.exception("ingress: a request failed")

    def _refusal(self, request: _Request) -> _Refusal | None:
        """What the head alone refuses, before any byte of the body is read; None to read the body."""
        if request.version not in ("1.0", "1.1"):
            return _Refusal(400, "invalid_request", f"the ingress takes HTTP/1.1, not HTTP/{request.version}")
        if request.method != b"POST" or request.target.partition(b"?")[0].decode("latin-1") not in PATHS:
            return _Refusal(404, "not_found", "the ingress forwards only POSTs to an engine's inference paths")
        if request.gate() not in self._gates:
            return _GATE_REFUSED
        lengths = request.header(b"content-length")  # the parser let one at most through, and only digits
        if request.header(b"transfer-encoding") or not lengths:
            return _Refusal(411, "invalid_request", "the ingress takes a body sent with Content-Length")
        if int(lengths[0]) > self._max_body:
            return _Refusal(413, "too_large", f"request body is larger than the limit of {self._max_body} bytes")
        return None

    async def _forward(self, request: _Request, caller: _Caller) -> bool:
        """``request`` forwarded and its answer relayed; True when the connection may carry the next."""
        port = self._gates.get(request.gate() or "")
        if port is None:  # its launch ended while it waited behind another request
            await _answer(caller.writer, *_GATE_REFUSED)
            return False
        watch = asyncio.ensure_future(caller.watch())
        try:
            relayed = await self._exchange(port, request.wire(), caller.writer, watch)
        finally:
            await _stopped(watch)  # before the next read of the server's connection: it may be in one
        if relayed is None:
            await _answer(caller.writer, 502, "engine_unavailable", "the engine behind this gate does not answer")
            return False
        outcome, engine = relayed
        if outcome is not _Outcome.COMPLETE or not engine.reusable():
            engine.close()  # at once, also when the server's connection went first
            return False
        idle = self._idle.setdefault(port, [])
        if len(idle) < _IDLE_PER_ENGINE and port in self._gates.values():
            idle.append(engine)
        else:
            engine.close()
        return request.keep_alive

    async def _exchange(self, port: int, wire: bytes, client: asyncio.StreamWriter, gone: asyncio.Future[None]
                        ) -> tuple[_Outcome, _Engine] | None:
        """``wire`` sent to the engine on ``port`` and its answer relayed, until whole or ``gone``; None when
        the engine cannot be reached."""
        relayed = await self._try(port, wire, client, gone, fresh=False)
        if relayed is not None and relayed[0] is _Outcome.UNANSWERED and relayed[1].reused:
            # a kept-alive connection the engine closed meanwhile: once more, afresh
            relayed = await self._try(port, wire, client, gone, fresh=True)
        return relayed

    async def _try(self, port: int, wire: bytes, client: asyncio.StreamWriter, gone: asyncio.Future[None],
                   fresh: bool) -> tuple[_Outcome, _Engine] | None:
        engine = await self._send(port, wire, client.transport, fresh)
        if engine is None:
            return None
        try:
            return await _relay(engine, client, gone), engine
        except BaseException:
            engine.close()  # cut short (the ingress stops, the server's side broke): the engine's side goes too
            raise

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


class _Request:
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


class _Caller:
    """The server's connection as httptools parses it, each read fed once: requests read whole wait in
    ``ready``, in order; the first refusal ends the parsing, and is answered after the requests before it."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                 check: Callable[[_Request], _Refusal | None], header_timeout: float, body_timeout: float) -> None:
        self.reader, self.writer = reader, writer
        self._check = check
        self._header_timeout, self._body_timeout = header_timeout, body_timeout
        self._parser = httptools.HttpRequestParser(self)  # strict: no set_dangerous_leniencies
        self._loop = asyncio.get_running_loop()
        self.ready: collections.deque[_Request] = collections.deque()
        self.refusal: _Refusal | None = None
        self._phase, self._since = _Phase.IDLE, self._loop.time()  # the phase, and when it began
        self._head_size = 0  # bytes fed since the last head was whole
        self._request = _Request()

    async def next_request(self) -> _Request | None:
        """The next request read whole; None once the connection is done with (a refusal or a timeout
        answered, the server gone, or idle too long)."""
        waited = self._loop.time()
        while not self.ready:
            if self.refusal is not None:
                await _answer(self.writer, *self.refusal)
                return None
            deadline, late = self._deadline(waited)
            try:
                async with asyncio.timeout_at(deadline):
                    data = await self.reader.read(_READ)
            except TimeoutError:
                if late is not None:
                    await _answer(self.writer, *late)
                return None
            if not data:
                return None  # the server closed its connection, mid-request too: nobody to answer
            self.feed(data)
        return self.ready.popleft()

    def _deadline(self, waited: float) -> tuple[float, _Refusal | None]:
        """When the wait for more ends, and what is answered then (nothing between requests). A request begun
        while the one before it was answered has its time counted from when it is waited for."""
        if self._phase is _Phase.IDLE:
            return waited + IDLE_TIMEOUT, None
        part, seconds = ("head", self._header_timeout) if self._phase is _Phase.HEAD else ("body", self._body_timeout)
        late = _Refusal(408, "request_timeout", f"the request's {part} did not arrive within {seconds:g} s")
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
                self._refuse(_Refusal(400, "invalid_request", f"the request's head is over {MAX_HEAD} bytes"))
                return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._refuse(_Refusal(400, "invalid_request", "the ingress does not upgrade connections"))
        except httptools.HttpParserError as exc:
            self._refuse(_Refusal(400, "invalid_request", f"the request is not valid HTTP/1.1: {exc}"))

    def _refuse(self, refusal: _Refusal) -> None:
        if self.refusal is None:
            self.refusal = refusal

    # httptools
    def on_message_begin(self) -> None:
        self._request = _Request()
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
        refusal = _Refusal(400, "invalid_request", "the ingress does not upgrade connections"
                           ) if parser.should_upgrade() else self._check(request)
        if refusal is not None:
            self._refuse(refusal)

    def on_body(self, body: bytes) -> None:
        self._request.body.append(body)

    def on_message_complete(self) -> None:
        self._phase, self._since = _Phase.IDLE, self._loop.time()
        if self.refusal is None:
            self.ready.append(self._request)


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


async def _relay(engine: _Engine, client: asyncio.StreamWriter, gone: asyncio.Future[None]) -> _Outcome:
    """Until the engine's answer is whole, or the engine's or the server's connection (``gone`` done) is gone;
    the server's side drained whenever it is full."""
    assert engine.ended is not None
    ended = engine.ended
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


async def _stopped(task: asyncio.Future[None]) -> None:
    """``task`` cancelled and ended; an error of its own (a bug) raised here rather than lost."""
    task.cancel()
    await asyncio.wait({task})
    error = None if task.cancelled() else task.exception()
    if error is not None:
        raise error


async def _answer(writer: asyncio.StreamWriter, status: int, code: str, message: str) -> None:
    body = msgspec.json.encode({"error": {"message": message, "type": "invalid_request_error"
                                          if status < 500 else "server_error", "code": code}})
    writer.write(b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close"
                 b"\r\n\r\n" % (status, _REASONS.get(status, b"Error"), len(body)) + body)
    try:
        await writer.drain()
    except ConnectionError:
        pass  # the server went away: the connection closes all the same


_REASONS = {400: b"Bad Request", 403: b"Forbidden", 404: b"Not Found", 408: b"Request Timeout",
            411: b"Length Required", 413: b"Content Too Large", 502: b"Bad Gateway"}
