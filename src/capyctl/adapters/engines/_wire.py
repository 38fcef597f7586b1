"""The streamed chat call to an engine: HTTP/1.1 on asyncio with httptools' C parser.

This is the relay's hot path, so it avoids a general HTTP client: each
socket read is parsed once by ``httptools`` and its body handed on whole,
from the connection's own callback, so the SSE parser and the client-side
write see every event that arrived together as one batch. Connections are
kept alive and reused
per engine address; a stream that was cut short closes its connection, which
is how an engine learns that its client is gone. The same session, over the
same pool, makes CapyCTL's other calls to an engine (``request``: probes,
metrics, park and wake), so that one client reaches the engines.

An engine on another machine is reached through its host's ingress, over
mutual TLS: its ``EngineAddress`` is ``https://<address>:<port>``, with the
host's name (``tls_name``) and the launch's gate key (``gate``) beside the
URL, never in it. The host's certificate must be of the CA given to
``trust``, name ``<host>``, and be the very certificate the host holds now (``pins``: its
fingerprint, checked on every new connection before a byte of a request
is written, and again when a pooled one is taken, so a certificate revoked
or replaced since opens nothing). The gate key goes in each request's
``X-CapyCTL-Gate`` header. Those connections are pooled like any other, so
a request finds its TLS handshake done. What goes wrong there is said in the
host's name (``HostUnreachable``), never with its address.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import ssl
from collections.abc import Awaitable, Callable
from typing import Any, cast
from urllib.parse import urlsplit

import anyio
import httptools

from capyctl.adapters.engines._http import engine_error
from capyctl.adapters.engines._sse import DEFAULT_MAX_EVENT, SseParser
from capyctl.domain.balancing import Unsent
from capyctl.domain.errors import CapyError, EdgeError, EngineUnavailable, HostUnreachable
from capyctl.domain.lifecycle import EngineAddress
from capyctl.domain.ports import EngineSession
from capyctl.domain.streams import Done, Relayed, StreamEvent

_HIGH_WATER = 1 << 20  # pause reading from the engine past 1 MiB not yet relayed
_MAX_ERROR_BODY = 64 * 1024
_IDLE_PER_ENGINE = 64
NOT_FORWARDED = b"x-capyctl-not-forwarded"  # on an answer a host's ingress gave itself: no engine saw the request
_MAX_ANSWER = 16 << 20  # bytes of one whole answer (a decision, a probe, a metrics read)
_TARGETS = 256  # engine addresses whose request heads are kept


class _Response(asyncio.Protocol):
    """One connection; httptools parses whatever the engine sends, and each read wakes the reader (or, while
    a stream is pumped, calls its ``sink``)."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.lost: BaseException | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.release_to: list[_Response] | None = None  # idle pool to join once the response completes
        self.pin: str | None = None  # a host's ingress: the fingerprint of the certificate it showed
        self.sink: Callable[[], None] | None = None  # a pump's: called at each read instead of waking a reader
        self.reset()

    def reset(self) -> None:
        """Ready for the next request on this connection."""
        self.status = 0
        self.content_type = b""
        self.not_forwarded = False  # a host's ingress answered itself (``X-CapyCTL-Not-Forwarded``)
        self.headers_done = False
        self.keep_alive = False
        self.complete = False
        self.body: list[bytes] = []
        self.buffered = 0
        self.paused = False
        self.saw_done = False  # the SSE stream ended with [DONE]; only HTTP framing may follow

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # (a connection's transport: a stream's)

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self.lost = exc
        if self.sink is not None:  # relayed right here, in this read's callback
            self.sink()
            return
        if self.buffered > _HIGH_WATER and self.transport is not None:
            self.transport.pause_reading()
            self.paused = True
        self._wake()

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self.complete:
            self.lost = self.lost or exc or ConnectionResetError("the engine closed the connection")
        self.transport = None
        if self.sink is not None:
            self.sink()
        self._wake()

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) == 12 and name.lower() == b"content-type":
            self.content_type = value.lower()
        elif len(name) == 23 and name.lower() == NOT_FORWARDED:
            self.not_forwarded = True

    def on_headers_complete(self) -> None:
        self.status = self.parser.get_status_code()
        self.keep_alive = self.parser.should_keep_alive()  # only valid while the message is parsed
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)
        self.buffered += len(body)

    def on_message_complete(self) -> None:
        self.complete = True
        if self.release_to is not None and self.reusable():
            self.release_to.append(self)
            self.release_to = None

    # the reader's side
    def _wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def wait(self) -> None:
        self.waiter = asyncio.get_running_loop().create_future()
        await self.waiter

    def take(self) -> bytes:
        data = b"".join(self.body) if len(self.body) != 1 else self.body[0]
        self.body.clear()
        self.buffered = 0
        if self.paused and self.transport is not None:
            self.paused = False
            self.transport.resume_reading()
        return data

    def reusable(self) -> bool:
        return self.complete and self.keep_alive and self.transport is not None and not self.transport.is_closing()

    def send(self, data: bytes) -> None:
        """Write ``data`` on the connection; on one closed meanwhile, nothing (``lost`` says why)."""
        if self.transport is not None:
            self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


class WireEngineSession(EngineSession):
    def __init__(self, max_event: int = DEFAULT_MAX_EVENT) -> None:
        self._idle: dict[tuple[str, int], list[_Response]] = {}
        self._max_event = max_event
        self._targets: dict[tuple[str, EngineAddress, str, str], tuple[str, int, bytes]] = {}
        self._spares: dict[tuple[str, int], asyncio.Future[None]] = {}  # connections being opened ahead
        self._tls: ssl.SSLContext | None = None
        self._pins: Callable[[str], str | None] = lambda host: None
        self._tls_names: dict[tuple[str, int], str] = {}  # an ingress's address -> the host its certificate names

    def trust(self, tls: ssl.SSLContext, pins: Callable[[str], str | None]) -> None:
        """Reach ``https://`` engine addresses (hosts' ingresses) with ``tls`` (the CA their certificates are of,
        and the client certificate the ingresses let in), each host held to the certificate ``pins(host)``
        names (its SHA-256; None: none is, the host is revoked)."""
        self._tls, self._pins = tls, pins

    def _target(self, address: EngineAddress, route: str, accept: str, method: str = "POST") -> tuple[str, int, bytes]:
        """(host, port, the request's head up to its Content-Length value) for ``method`` on ``route`` (a path,
        with its query if any) at ``address``: worked out once per engine address, not per request. A POST
        carries JSON; a GET carries nothing (Content-Length: 0)."""
        known = self._targets.get((method, address, route, accept))
        if known is None:
            url = urlsplit(address.url)
            host, port = url.hostname or "127.0.0.1", url.port or 80
            path = url.path.rstrip("/") + route
            typed = "Content-Type: application/json\r\n" if method == "POST" else ""
            named = host
            if url.scheme == "https":  # a host's ingress: the name its certificate holds, the launch's gate key
                named = self._tls_names[(host, port)] = address.tls_name or host
                typed += f"X-CapyCTL-Gate: {address.gate or ''}\r\n"
            head = (
                f"{method} {path} HTTP/1.1\r\nHost: {named}:{port}\r\n{typed}Accept: {accept}\r\nContent-Length: "
            ).encode()
            if len(self._targets) >= _TARGETS:  # engines restart on new ports: keep the newest few
                self._targets.clear()
            known = self._targets[(method, address, route, accept)] = (host, port, head)
        return known

    def _idle_connection(self, host: str, port: int) -> _Response | None:
        """A kept-alive connection to the engine that is still open, taken from the pool; None if none is.
        One to a host's ingress is taken only while the host still holds the certificate it showed."""
        idle = self._idle.get((host, port))
        while idle:
            conn = idle.pop()
            if conn.transport is not None and not conn.transport.is_closing():
                if conn.pin is None or conn.pin == self._pins(self._tls_names[(host, port)]):
                    return conn
                conn.close()  # its host was revoked, or joined again with another certificate, since
        return None

    async def _connection(self, host: str, port: int) -> tuple[_Response, bool]:
        conn = self._idle_connection(host, port)
        if conn is not None:
            return conn, True
        try:
            conn = await self._open((host, port))
        except (OSError, ssl.SSLError) as exc:  # nothing was written: the request may go to another instance
            cause = Unsent.TLS if isinstance(exc, ssl.SSLError) else Unsent.REFUSED
            name = self._tls_names.get((host, port))
            if name is not None:  # never an internal address in what a client may read
                error: EngineUnavailable = HostUnreachable(name, f"its ingress could not be reached ({_why(exc)})")
            else:
                error = EngineUnavailable(f"could not reach the engine at {host}:{port}: {exc.strerror or exc}")
            raise error.before_sending(cause) from exc
        except HostUnreachable as exc:  # a certificate the host does not hold now, or no CA: nothing was written
            raise exc.before_sending(Unsent.TLS) from None
        return conn, False

    async def _open(self, key: tuple[str, int]) -> _Response:
        """A new connection to the engine at ``key``: plain on this machine, mutual TLS to a host's ingress,
        whose certificate must be the one its host holds now (checked before anything is written)."""
        loop = asyncio.get_running_loop()
        name = self._tls_names.get(key)
        if name is None:
            _, conn = await loop.create_connection(_Response, *key)
            return conn
        if self._tls is None:
            raise HostUnreachable(name, "this process has no CA to check hosts with (only capyctl start server does)")
        transport, conn = await loop.create_connection(
            _Response, *key, ssl=self._tls, server_hostname=name, ssl_handshake_timeout=10.0
        )
        shown = transport.get_extra_info("ssl_object").getpeercert(binary_form=True)
        conn.pin = hashlib.sha256(shown).hexdigest() if shown else None
        if conn.pin is None or conn.pin != self._pins(name):
            transport.abort()  # not a byte of any request goes to it
            raise HostUnreachable(
                name,
                "its ingress showed a certificate the host does not hold now (revoked, or "
                "replaced by a new join): refused",
            )
        return conn

    async def _send(
        self, host: str, port: int, head: bytes, body: bytes, written: _Response | None = None
    ) -> _Response:
        """The request written (``written``: already, on that pooled connection) and the answer's head read."""
        for _ in range(2):  # a pooled connection the engine closed meanwhile gets one fresh retry
            if written is None:
                conn, reused = await self._connection(host, port)
            else:
                conn, reused = written, True
            try:
                if conn is not written:
                    conn.reset()
                    conn.send(_request(head, body))
                written = None
                while not conn.headers_done and conn.lost is None:
                    await conn.wait()
            except BaseException:
                conn.close()  # cut before the engine answered: closing is how it learns to stop
                raise
            if conn.headers_done:
                return conn
            if not reused:
                break
        name = self._tls_names.get((host, port))
        if name is not None:
            raise HostUnreachable(name, "its ingress closed the connection before an answer")
        raise EngineUnavailable(f"the engine at {host}:{port} closed the connection: {conn.lost!r}")

    def chat_stream(self, address: EngineAddress, body: bytes) -> _ChatStream:
        """(see ``EngineSession``). The request is written at once when a kept-alive connection to the engine
        stands idle: the engine starts on it while the caller does what it has left to do before it enters."""
        host, port, head = self._target(address, "/v1/chat/completions", "text/event-stream")
        conn = self._idle_connection(host, port)
        if conn is not None:
            conn.reset()
            conn.send(_request(head, body))
        return _ChatStream(self, host, port, head, body, conn)

    async def decide(self, address: EngineAddress, body: bytes) -> bytes:
        """POST a decision request; the engine's whole answer (200). Raises ``EngineError`` for a refusal,
        ``EngineUnavailable`` when the engine cannot be reached; a cut closes the connection."""
        host, port, head = self._target(address, "/v1/systemone", "application/json")
        status, answer, not_forwarded = await self._exchange(host, port, head, body, _MAX_ANSWER)
        if status != 200:
            raise self._refusal(host, port, status, answer, not_forwarded)
        return answer

    def _refusal(self, host: str, port: int, status: int, body: bytes, not_forwarded: bool = False) -> CapyError:
        """An engine's error answer; or, from a host's ingress, its own refusal of the server, which is between
        the server and its hosts: a client reads it as the host out of reach, never as the ingress's words
        (and an ingress that could not reach its engine, saying it forwarded nothing, as the engine unreachable:
        the request may go to another instance)."""
        error = engine_error(status, body)
        name = self._tls_names.get((host, port))
        if name is not None and error.code == "gate_refused":
            return HostUnreachable(
                name,
                "its agent does not know this launch's gate key (its agent restarted, or the launch ended)",
                reason="reconnecting",
            ).before_sending(Unsent.GATE_CLOSED)
        if name is not None and not_forwarded and status >= 500:
            return EngineUnavailable(f"the engine on host {name!r} does not answer its ingress").before_sending(
                Unsent.NOT_FORWARDED
            )
        return error

    async def request(
        self, method: str, url: str, body: bytes | None = None, timeout: float | None = 10.0, limit: int = _MAX_ANSWER
    ) -> tuple[int, bytes]:
        """Any other call to an engine (a probe, a metrics read, a park or a wake): ``method`` on ``url``
        (``http://host:port/path?query``), ``body`` sent as JSON; the answer's status and whole body, whatever
        the status. On the pool the streams use: a kept-alive connection is taken if one stands idle, and
        goes back once the answer is complete.

        Raises ``EngineUnavailable`` when the engine cannot be reached, closes the connection before its answer
        ends, or has not answered in ``timeout`` seconds (None: no limit); ``EdgeError`` for an answer past
        ``limit`` bytes. A request cut short (that timeout, a cancellation, a refused size) closes its
        connection, which is how an engine learns to stop; it never goes back to the pool. An answer whose
        end is only the connection's close (no length, not chunked) reads as broken."""
        parts = urlsplit(url)
        route = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        host, port, head = self._target(EngineAddress(f"{parts.scheme}://{parts.netloc}"), route, "*/*", method)
        try:
            with anyio.fail_after(timeout):
                status, answer, _ = await self._exchange(host, port, head, body or b"", limit)
                return status, answer
        except TimeoutError as exc:
            raise EngineUnavailable(
                f"the engine at {host}:{port} did not answer {method} {route} within {timeout} s"
            ) from exc

    async def _exchange(self, host: str, port: int, head: bytes, body: bytes, limit: int) -> tuple[int, bytes, bool]:
        """The request sent and its whole answer read (status, body, and whether a host's ingress said it
        forwarded nothing); the connection is pooled again after it."""
        conn = await self._send(host, port, head, body)
        parts: list[bytes] = []
        size = 0
        try:
            while True:
                if conn.body:
                    parts.append(conn.take())
                    size += len(parts[-1])
                    if size > limit:
                        raise EdgeError(f"the engine's answer is larger than {limit} bytes")
                    continue
                if conn.complete:
                    break
                if conn.lost is not None:
                    raise EngineUnavailable(f"the engine connection broke before its answer ended: {conn.lost!r}")
                await conn.wait()
        except BaseException:
            conn.close()  # cut short (client gone, deadline, too large): closing tells the engine to stop
            raise
        self._release(conn, (host, port))
        return conn.status, b"".join(parts), conn.not_forwarded

    def _spare(self, key: tuple[str, int]) -> None:
        """Open a connection to the engine at ``key`` to stand idle, when none does: one CapyCTL closed to cut
        a request is replaced at once, so that the next request is written to the engine as it comes
        rather than after a connect. An engine that refuses it, or closes it later, is left
        be: a request then connects as it would have."""
        if self._idle.get(key) or key in self._spares:
            return

        async def spare() -> None:
            try:
                conn = await self._open(key)
            except (OSError, ssl.SSLError, EngineUnavailable):
                return
            finally:
                del self._spares[key]
            idle = self._idle.setdefault(key, [])
            if len(idle) < _IDLE_PER_ENGINE:
                idle.append(conn)
            else:
                conn.close()

        self._spares[key] = asyncio.ensure_future(spare())  # (kept here: the loop holds a task weakly)

    def _release(self, conn: _Response, key: tuple[str, int]) -> None:
        """Keep a finished connection for the next request to this engine."""
        idle = self._idle.setdefault(key, [])
        if len(idle) >= _IDLE_PER_ENGINE:
            conn.close()
        elif conn.reusable():
            idle.append(conn)
        elif conn.saw_done and conn.lost is None:
            # [DONE] came; the end of the HTTP message has not yet: join the pool when it does,
            # and close if it never comes
            conn.release_to = idle
            asyncio.get_running_loop().call_later(5.0, _close_unreleased, conn)
        else:
            conn.close()


def _why(exc: BaseException) -> str:
    """An OS or TLS error in a few words, without the address it was about."""
    if isinstance(exc, ssl.SSLError):
        return f"TLS: {exc.reason or type(exc).__name__}"
    if isinstance(exc, OSError) and exc.errno:  # (asyncio's strerror names the address it tried)
        return os.strerror(exc.errno).lower()
    return type(exc).__name__


def _request(head: bytes, body: bytes) -> bytes:
    """A request to send: its head up to the Content-Length value (``_target``), then the body."""
    return b"%b%d\r\n\r\n%b" % (head, len(body), body)


def _close_unreleased(conn: _Response) -> None:
    if conn.release_to is not None:
        conn.release_to = None
        conn.close()


class _ChatStream:
    """``chat_stream``'s answer, one object from the request to the answer's end: the request sent and the
    answer's head read on entry, which gives the stream itself (``EngineAnswer``: its events pumped, each
    read parsed and handed on in the connection's own callback, with no wake-up of the relaying task per
    read); on the way out the connection goes back to the pool, or is closed when the stream was cut short
    (client gone, refused chunk, error): closing tells the engine to stop. A class rather than a generator:
    a request's way in and out of it is two calls, not a generator's machinery."""

    __slots__ = ("_session", "_host", "_port", "_head", "_body", "_conn", "_written", "_parser")

    def __init__(
        self, session: WireEngineSession, host: str, port: int, head: bytes, body: bytes, written: _Response | None
    ) -> None:
        self._session = session
        self._host, self._port, self._head, self._body = host, port, head, body
        self._conn: _Response | None = None
        self._written = written  # the pooled connection the request went out on already, if any
        self._parser: SseParser | None = None

    def abandon(self) -> None:
        """Never to be entered: a request written already is cut (its connection closed)."""
        if self._written is not None:
            self._written.close()
            self._written = None

    async def __aenter__(self) -> _ChatStream:
        written, self._written = self._written, None
        conn = self._conn = await self._session._send(self._host, self._port, self._head, self._body, written)
        try:
            if conn.status != 200:
                while not conn.complete and conn.lost is None and conn.buffered < _MAX_ERROR_BODY:
                    await conn.wait()
                raise self._session._refusal(self._host, self._port, conn.status, conn.take(), conn.not_forwarded)
            if conn.content_type and not conn.content_type.startswith(b"text/event-stream"):
                raise await _not_a_stream(conn)
            self._parser = SseParser(self._session._max_event)
            return self
        except BaseException:
            conn.close()
            raise

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: Any) -> None:
        conn = self._conn
        assert conn is not None
        if kind is not None:
            healthy = conn.lost is None and conn.transport is not None
            conn.close()  # cut short: closing tells the engine to stop
            if healthy:  # the engine is there: the next request finds a connection open
                self._session._spare((self._host, self._port))
            return
        if conn.saw_done and not conn.complete and conn.lost is None:
            # only the end of the HTTP message is missing and it is a few bytes behind:
            # wait for it briefly, so that the connection can serve the next request
            with anyio.move_on_after(0.02):
                while not conn.complete and conn.lost is None:
                    await conn.wait()
        self._session._release(conn, (self._host, self._port))

    def _events(self, conn: _Response, parser: SseParser, data: bytes) -> list[StreamEvent]:
        events = parser.feed(data)
        if events and type(events[-1]) is Done:
            conn.saw_done = True
        return events

    async def pump(self, deliver: Callable[[list[StreamEvent]], Relayed], drain: Callable[[], Awaitable[None]]) -> bool:
        """(see ``EngineAnswer``)"""
        conn, parser = self._conn, self._parser
        assert conn is not None and parser is not None, "pump() runs inside the stream's async with"
        loop = asyncio.get_running_loop()
        state: list[Any] = [None]  # the waiter of this turn

        def sink() -> None:
            waiter = state[0]
            if waiter is None or waiter.done():  # cut (the waiter was cancelled) or already told
                return
            try:
                full = False
                while conn.body:  # a read is relayed whole, even past a full client: it is in memory already
                    batch = self._events(conn, parser, conn.take())
                    if batch:
                        said = deliver(batch)
                        if said is Relayed.ENDED:
                            waiter.set_result(True)
                            return
                        if waiter.done():  # cut meanwhile
                            return
                        if parser.failed is not None:  # the events before an oversized one went out
                            raise parser.failed
                        full = full or said is Relayed.FULL
                if full:
                    if conn.transport is not None:
                        conn.transport.pause_reading()
                    waiter.set_result(_PAUSED)
                elif conn.complete:
                    last = parser.close()
                    waiter.set_result(bool(last) and deliver(last) is Relayed.ENDED)
                elif conn.lost is not None:
                    waiter.set_exception(EngineUnavailable(f"the engine connection broke: {conn.lost!r}"))
            except BaseException as exc:  # handed to the task, which raises it
                waiter.set_exception(exc)

        conn.sink = sink
        try:
            while True:
                state[0] = waiter = loop.create_future()
                sink()  # what came before (or with) the head, or while paused
                outcome = await waiter
                if outcome is not _PAUSED:
                    return bool(outcome)
                await drain()
                if conn.transport is not None:
                    conn.transport.resume_reading()
        finally:
            conn.sink = None


async def _not_a_stream(conn: _Response) -> EdgeError:
    """The engine answered 200 with something else than SSE (an HTML page, one JSON object ...)."""
    with anyio.move_on_after(1.0):
        while not conn.complete and conn.lost is None and conn.buffered < 512:
            await conn.wait()
    start = conn.take()[:200].decode("utf-8", "replace")
    kind = conn.content_type.decode("latin-1")
    hint = (
        " (an engine that ignores stream: true answers one JSON object)" if kind.startswith("application/json") else ""
    )
    return EdgeError(f"the engine answered 200 with content type {kind!r} instead of an SSE stream{hint}: {start!r}")


_PAUSED = object()
