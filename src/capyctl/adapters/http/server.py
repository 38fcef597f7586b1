"""CapyCTL's HTTP/1.1 server: asyncio and httptools' public parser, with the limits an open port needs.

Both listeners (inference and management) run it. A connection parses its
requests with ``httptools.HttpRequestParser``; each request is read whole
(within ``max_body``) before anything answers it, then handed to the handler
for its path as an ``Exchange`` (``exchange.py``) in a task of its own. Paths
without a handler go to an ASGI application (Litestar), through the same
``Exchange``. One request is answered at a time per connection: a pipelined
one waits, with reading paused, until the answer before it is complete.

The limits, each answered in CapyCTL's error envelope with a request ID:

- a client has ``header_timeout`` seconds from connecting (or from the first
  byte of its next request) to finish its headers, then ``body_timeout``
  seconds to finish its body: past either, 408 ``request_timeout``;
- a body declared or grown past ``max_body``: 413 ``too_large`` at once;
- past ``max_connections`` open connections, a new one gets 503
  ``too_many_connections`` with ``Retry-After``;
- a request the parser refuses (a bad chunk size, two lengths, a bad header
  name or value ...): 400 ``invalid_request``;
- a kept-alive connection idle for ``keep_alive`` seconds is closed.

Each of these answers closes the connection. Each cut and refusal is counted
through ``on_cut(kind)`` for Prometheus.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
from collections.abc import Awaitable, Callable
from typing import Any, cast
from urllib.parse import unquote

import httptools

from capyctl.adapters.http.errors import error_body, status_of
from capyctl.adapters.http.exchange import Exchange, raw_error
from capyctl.domain.errors import CapyError, InvalidRequest, TooLarge, TooManyConnections
from capyctl.domain.limits import Limits

log = logging.getLogger("capyctl.http")
Handler = Callable[[Exchange], Awaitable[None]]  # called at once; what it returns is awaited in the request's task
KEEP_ALIVE = 5.0  # seconds a kept-alive connection may stand idle between requests


class RequestTimeout(CapyError):
    code = "request_timeout"


class HttpServer:
    """One listener: ``handlers`` by path, ``fallback`` (an ASGI app) for every other path."""

    def __init__(
        self,
        handlers: dict[str, Handler],
        fallback: Any,
        limits: Limits,
        on_cut: Callable[[str], None],
        keep_alive: float = KEEP_ALIVE,
    ) -> None:
        self.handlers = handlers
        self.keep_alive = keep_alive
        self.fallback = fallback
        self.limits = limits
        self.on_cut = on_cut
        self.connections: set[Connection] = set()
        self.tasks: set[asyncio.Task[None]] = set()

    async def serve(self, sock: Any, stopping: Any, grace: float = 5.0) -> None:
        """Serve on the listening socket until ``stopping`` is set; then close idle connections, give
        requests in progress ``grace`` seconds, and cancel what is left."""
        loop = asyncio.get_running_loop()
        server = await loop.create_server(lambda: Connection(self), sock=sock)
        try:
            await stopping.wait()
        finally:
            server.close()
            for connection in list(self.connections):
                connection.shutdown()
            if self.tasks:
                await asyncio.wait(list(self.tasks), timeout=grace)
            for task in list(self.tasks):
                task.cancel()
            for connection in list(self.connections):
                connection.abort()


class Connection(asyncio.Protocol):
    """One client connection: parses its requests, answers them one at a time, applies the limits."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.limits = server.limits
        self.loop = asyncio.get_running_loop()
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        self.phase = ""  # what the timer times: headers, body or idle
        self.exchange: Exchange | None = None  # the request being answered
        self.waiting: list[Exchange] = []  # pipelined requests read whole, behind it
        self.closing = False  # no request after the one being answered (HTTP/1.0, Connection: close, shutdown)
        self.write_paused = False
        self.drained: asyncio.Future[None] | None = None
        self._reset()

    def _reset(self) -> None:
        """Ready to parse the next request."""
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.size = 0
        self.parsing = False  # a request's bytes have begun

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream server's connection: a full Transport
        self.server.connections.add(self)
        if len(self.server.connections) > self.limits.max_connections:
            self.refuse(TooManyConnections(self.limits.max_connections), "too_many_connections", retry_after=1)
            return
        self.arm(self.limits.header_timeout, "headers")

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self.refuse(InvalidRequest("CapyCTL does not upgrade HTTP connections"), "invalid_request")
        except httptools.HttpParserError as exc:
            self.refuse(_parser_error(exc, data), "invalid_request")

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm()
        self.server.connections.discard(self)
        self.transport = None
        for exchange in (self.exchange, *self.waiting):
            if exchange is not None:
                exchange.lost()
        self.waiting.clear()
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    def pause_writing(self) -> None:
        self.write_paused = True

    def resume_writing(self) -> None:
        self.write_paused = False
        if self.drained is not None and not self.drained.done():
            self.drained.set_result(None)

    async def drain(self) -> None:
        """Return once the client can take more (or is gone)."""
        if self.write_paused and self.transport is not None:
            self.drained = self.loop.create_future()
            await self.drained

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.parsing = True
        if self.timer is None or self.phase == "idle":  # the next request on a kept-alive connection: its
            self.arm(self.limits.header_timeout, "headers")  # headers' time starts with its first byte

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.disarm()
        limit = self.limits.max_body
        declared = _content_length(self.headers)
        if declared is not None and declared > limit:
            self.refuse(TooLarge(limit), "too_large")
            return
        if (b"expect", b"100-continue") in self.headers and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        self.arm(self.limits.body_timeout, "body")

    def on_body(self, body: bytes) -> None:
        self.size += len(body)
        if self.size > self.limits.max_body:
            self.refuse(TooLarge(self.limits.max_body), "too_large")
            return
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.disarm()
        parser = self.parser
        path, _, query = self.url.partition(b"?")
        exchange = Exchange(
            self,
            parser.get_method().decode("ascii"),
            unquote(path.decode("latin-1")),
            query,
            self.headers,
            b"".join(self.body),
            parser.get_http_version() != "1.0" and parser.should_keep_alive(),
        )
        self._reset()
        if self.transport is None or self.transport.is_closing():
            return
        if self.exchange is None:
            self.start(exchange)
        else:  # pipelined behind an answer still going out
            self.waiting.append(exchange)
            self.transport.pause_reading()

    # requests
    def start(self, exchange: Exchange) -> None:
        """Answer ``exchange``: its handler is called at once (a request's front, and its engine write where
        nothing has to wait, before a task's first turn), in the context the task it returns then runs in."""
        self.exchange = exchange
        handler = self.server.handlers.get(exchange.path)
        context = contextvars.copy_context()
        task = self.loop.create_task(exchange.run(context.run(exchange.begin, handler)), context=context)
        self.server.tasks.add(task)
        task.add_done_callback(self.server.tasks.discard)

    def answered(self, exchange: Exchange) -> None:
        """``exchange``'s answer is complete: the next request, or the wait for one."""
        if exchange is not self.exchange:
            return
        self.exchange = None
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if not exchange.keep_alive or self.closing:
            transport.close()
        elif self.waiting:
            self.start(self.waiting.pop(0))
            if not self.waiting:
                transport.resume_reading()
        elif not self.parsing:
            self.arm(self.server.keep_alive, "idle")

    def shutdown(self) -> None:
        """The server stops: an idle connection closes now, a busy one after its answer."""
        self.closing = True
        if self.exchange is None and self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # limits
    def arm(self, seconds: float, phase: str) -> None:
        self.disarm()
        self.phase = phase
        self.timer = self.loop.call_later(seconds, self.too_slow, phase)

    def disarm(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def too_slow(self, phase: str) -> None:
        self.timer = None
        if self.transport is None or self.transport.is_closing():
            return
        if phase == "idle":
            self.transport.close()
            return
        seconds = self.limits.header_timeout if phase == "headers" else self.limits.body_timeout
        error = RequestTimeout(
            f"the request's {phase} did not arrive within {seconds:g} s; the connection was closed", phase=phase
        )
        self.refuse(error, f"slow_{phase}")

    def refuse(self, error: CapyError, kind: str, retry_after: int | None = None) -> None:
        """Answer ``error`` (unless an answer is going out already) and close the connection; counted once
        (the rest of a read the parser goes on with after a refusal is not refused again)."""
        self.disarm()
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        self.server.on_cut(kind)
        if self.exchange is None or not self.exchange.started:
            transport.write(raw_error(status_of(error), error_body(error), retry_after))
        transport.close()


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length" and value.strip().isdigit():
            return int(value)
    return None


def _parser_error(exc: Exception, data: bytes) -> InvalidRequest:
    """What the parser refused, as the client's error; the caller's X-Request-Id named when it is the culprit
    (a control character in its value, which no header may hold)."""
    for line in data.split(b"\n"):
        if line[:13].lower() == b"x-request-id:" and any(c < 32 and c not in (9, 13) or c == 127 for c in line):
            return InvalidRequest(
                "X-Request-Id must be 1 to 128 printable ASCII characters without spaces", param="X-Request-Id"
            )
    return InvalidRequest(f"the request is not valid HTTP/1.1 ({exc}); the connection was closed")
