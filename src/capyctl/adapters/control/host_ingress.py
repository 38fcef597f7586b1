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
import enum
import logging
import socket
import ssl
from typing import cast

import anyio
import httptools

from capyctl.adapters.control.host_ingress_requests import GATE_REFUSED, MAX_HEAD, Caller, Refusal, Request, answer
from capyctl.adapters.pki import server_ssl_context
from capyctl.domain.limits import HOST_MAX_BODY, Limits

log = logging.getLogger("capyctl.ingress")
PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/systemone"})
MAX_BODY = HOST_MAX_BODY
HEADER_TIMEOUT = Limits().header_timeout  # the server's own door's (limits.client_header_timeout)
BODY_TIMEOUT = Limits().body_timeout  # the same (limits.client_body_timeout)
_CLOSE_BOUND = 5.0  # seconds serve waits for its cancelled connections, which end at once unless a bug holds one
_IDLE_PER_ENGINE = 64  # kept-alive connections to one engine
_HIGH_WATER = 1 << 20  # bytes waiting for the server's connection past which the engine is read no more


class Ingress:
    def __init__(
        self,
        cert_pem: bytes,
        key_pem: bytes,
        max_body: int = MAX_BODY,
        *,
        header_timeout: float = HEADER_TIMEOUT,
        body_timeout: float = BODY_TIMEOUT,
    ) -> None:
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
        caller = Caller(reader, writer, self._refusal, self._header_timeout, self._body_timeout)
        try:
            while (request := await caller.next_request()) is not None and await self._forward(request, caller):
                pass
        except OSError:
            pass  # the server went away (a reset, a broken TLS record): nothing to answer
        except Exception:  # a bug of the ingress: this connection fails, the ingress goes on
            log.exception("ingress: a request failed")

    def _refusal(self, request: Request) -> Refusal | None:
        """What the head alone refuses, before any byte of the body is read; None to read the body."""
        if request.version not in ("1.0", "1.1"):
            return Refusal(400, "invalid_request", f"the ingress takes HTTP/1.1, not HTTP/{request.version}")
        if request.method != b"POST" or request.target.partition(b"?")[0].decode("latin-1") not in PATHS:
            return Refusal(404, "not_found", "the ingress forwards only POSTs to an engine's inference paths")
        if request.gate() not in self._gates:
            return GATE_REFUSED
        lengths = request.header(b"content-length")  # the parser let one at most through, and only digits
        if request.header(b"transfer-encoding") or not lengths:
            return Refusal(411, "invalid_request", "the ingress takes a body sent with Content-Length")
        if int(lengths[0]) > self._max_body:
            return Refusal(413, "too_large", f"request body is larger than the limit of {self._max_body} bytes")
        return None

    async def _forward(self, request: Request, caller: Caller) -> bool:
        """``request`` forwarded and its answer relayed; True when the connection may carry the next."""
        port = self._gates.get(request.gate() or "")
        if port is None:  # its launch ended while it waited behind another request
            await answer(caller.writer, *GATE_REFUSED)
            return False
        watch = asyncio.ensure_future(caller.watch())
        try:
            relayed = await self._exchange(port, request.wire(), caller.writer, watch)
        finally:
            await _stopped(watch)  # before the next read of the server's connection: it may be in one
        if relayed is None:
            await answer(caller.writer, 502, "engine_unavailable", "the engine behind this gate does not answer")
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

    async def _exchange(
        self, port: int, wire: bytes, client: asyncio.StreamWriter, gone: asyncio.Future[None]
    ) -> tuple[_Outcome, _Engine] | None:
        """``wire`` sent to the engine on ``port`` and its answer relayed, until whole or ``gone``; None when
        the engine cannot be reached."""
        relayed = await self._try(port, wire, client, gone, fresh=False)
        if relayed is not None and relayed[0] is _Outcome.UNANSWERED and relayed[1].reused:
            # a kept-alive connection the engine closed meanwhile: once more, afresh
            relayed = await self._try(port, wire, client, gone, fresh=True)
        return relayed

    async def _try(
        self, port: int, wire: bytes, client: asyncio.StreamWriter, gone: asyncio.Future[None], fresh: bool
    ) -> tuple[_Outcome, _Engine] | None:
        engine = await self._send(port, wire, client.transport, fresh)
        if engine is None:
            return None
        try:
            return await _relay(engine, client, gone), engine
        except BaseException:
            engine.close()  # cut short (the ingress stops, the server's side broke): the engine's side goes too
            raise

    async def _send(self, port: int, request: bytes, client: asyncio.WriteTransport, fresh: bool) -> _Engine | None:
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
        self.transport = cast(asyncio.Transport, transport)  # a stream connection's: a full Transport

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
