"""uvicorn's httptools protocol with the client-side limits CapyCTL needs on an open port.

uvicorn holds a connection that sends part of its headers, or part of its
body, for as long as the client likes, and has no cap on connections that
answers in CapyCTL's error envelope. This subclass adds both:

- a client has ``header_timeout`` seconds from connecting (or from the first
  byte of its next request on a kept-alive connection) to finish its
  headers, and ``body_timeout`` seconds from there to finish its body; past
  either it gets 408 ``request_timeout`` and the connection is closed. A
  request cut this way never reaches an engine: CapyCTL reads the whole body
  before it asks one.
- past ``max_connections`` open connections, a new one gets 503
  ``too_many_connections`` with ``Retry-After`` and is closed at once.

Each cut and refusal is counted through ``on_cut(kind)`` for Prometheus.

Given a ``door`` (the inference port's front door), requests to its paths
skip the ASGI layer: the protocol hands them to the door as a
``WireExchange`` (see ``exchange.py``) where uvicorn would build its ASGI
cycle; every other request is uvicorn's as before.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

import httptools
from uvicorn.logging import TRACE_LOG_LEVEL
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.utils import get_local_addr, get_remote_addr, is_ssl

from capyctl.adapters.http.ids import new_request_id
from capyctl.adapters.http.errors import error_body, status_of
from capyctl.adapters.http.exchange import WireExchange
from capyctl.domain.errors import CapyError, TooManyConnections
from capyctl.domain.limits import Limits


class RequestTimeout(CapyError):
    code = "request_timeout"


def raw_error(error: CapyError, retry_after: int | None = None) -> bytes:
    """A whole HTTP/1.1 error answer that closes the connection, for use below the ASGI layer."""
    body = error_body(error)
    status = status_of(error)
    head = [
        f"HTTP/1.1 {status} {'Request Timeout' if status == 408 else 'Service Unavailable'}",
        "content-type: application/json",
        f"content-length: {len(body)}",
        "cache-control: no-store",
        f"x-capyctl-request-id: {new_request_id()}",
        "connection: close",
    ]
    if retry_after is not None:
        head.append(f"retry-after: {retry_after}")
    return ("\r\n".join(head) + "\r\n\r\n").encode() + body


class LeanFlowControl(FlowControl):
    """uvicorn's flow control, whose event for a paused write is made only when a write pauses (most
    connections never do) rather than with every connection."""

    def __init__(self, transport: asyncio.Transport) -> None:  # (no super().__init__: its event is the cost)
        self._transport = transport
        self.read_paused = False
        self.write_paused = False
        self._is_writable_event: asyncio.Event | None = None  # type: ignore[assignment]

    async def drain(self) -> None:
        if self._is_writable_event is not None:
            await self._is_writable_event.wait()

    def pause_writing(self) -> None:
        if not self.write_paused:
            self.write_paused = True
            if self._is_writable_event is None:
                self._is_writable_event = asyncio.Event()
            self._is_writable_event.clear()

    def resume_writing(self) -> None:
        if self.write_paused:
            self.write_paused = False
            if self._is_writable_event is not None:
                self._is_writable_event.set()


def guarded_protocol(limits: Limits, on_cut: Callable[[str], None], door: Any = None) -> type[HttpToolsProtocol]:
    """The protocol class to give uvicorn (``http=``), bound to these limits; with ``door`` (an object with
    ``endpoints``, a dict by path, and ``serve(exchange)``), that door answers its paths on the wire."""
    hot = {path.encode() for path in door.endpoints} if door is not None else set()

    class GuardedProtocol(HttpToolsProtocol):
        _timer: asyncio.TimerHandle | None = None
        _addresses: tuple[Any, Any, Any] | None = None  # (server, client, scheme), read when first asked
        _body_due = False  # a request's headers are in and its body's timer is to be armed
        _loggers: tuple[Any, Any, bool]
        _made_for: tuple[Any, Any, Any, Any] | None = None  # (config, server_state, app_state, loop)

        def __init__(self, config: Any, server_state: Any, app_state: dict[str, Any],
                     _loop: asyncio.AbstractEventLoop | None = None) -> None:
            # uvicorn's __init__ looks up its two loggers (a lock each) and asks one for its handlers on every
            # connection; the first connection of a server does that, the others take its answers
            made = self._made_for
            if made is None or made[0] is not config or made[1] is not server_state or made[2] is not app_state:
                super().__init__(config, server_state, app_state, _loop)
                cls = type(self)
                cls._made_for = (config, server_state, app_state, self.loop)
                cls._loggers = (self.logger, self.access_logger, self.access_log)
                return
            self.config = config
            self.app = config.loaded_app
            self.loop = _loop or made[3]
            self.logger, self.access_logger, self.access_log = self._loggers
            self.parser = httptools.HttpRequestParser(self)
            self.parser.set_dangerous_leniencies(lenient_data_after_close=True)
            self.ws_protocol_class = config.ws_protocol_class
            self.root_path = config.root_path
            self.asgi_version = config.asgi_version
            self.limit_concurrency = config.limit_concurrency
            self.app_state = app_state
            self.timeout_keep_alive_task = None
            self.timeout_keep_alive = config.timeout_keep_alive
            self.server_state = server_state
            self.connections = server_state.connections
            self.tasks = server_state.tasks
            self.transport = None  # type: ignore[assignment]
            self.flow = None  # type: ignore[assignment]
            self.pipeline = deque()
            self.scope = None  # type: ignore[assignment]
            self.headers = None  # type: ignore[assignment]
            self.expect_100_continue = False
            self.cycle = None  # type: ignore[assignment]

        # uvicorn reads the connection's addresses and scheme as it is made (three calls into the transport
        # and a socket object each time); only an ASGI request's scope and uvicorn's trace log use them,
        # so they are read when first asked for
        def _address(self, index: int) -> Any:
            if self._addresses is None:
                transport = self.transport
                self._addresses = (get_local_addr(transport), get_remote_addr(transport),
                                   "https" if is_ssl(transport) else "http")
            return self._addresses[index]

        server = property(lambda self: self._address(0), lambda self, value: None)  # type: ignore[assignment]
        client = property(lambda self: self._address(1), lambda self, value: None)  # type: ignore[assignment]
        scheme = property(lambda self: self._address(2), lambda self, value: None)  # type: ignore[assignment]

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            # uvicorn's connection_made, less the addresses (see above)
            self.connections.add(self)
            self.transport = transport
            self.flow = LeanFlowControl(transport)
            if self.logger.level <= TRACE_LOG_LEVEL:
                prefix = "%s:%d - " % self.client if self.client else ""
                self.logger.log(TRACE_LOG_LEVEL, "%sHTTP connection made", prefix)
            if len(self.connections) > limits.max_connections:
                on_cut("too_many_connections")
                transport.write(raw_error(TooManyConnections(limits.max_connections), retry_after=1))
                transport.close()
                return
            self._arm(limits.header_timeout, "headers")

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def on_message_begin(self) -> None:
            if hot:  # uvicorn's ASGI scope is made once the path is known, and only for an ASGI request
                self.url = b""
                self.expect_100_continue = False
                self.headers = []
            else:
                super().on_message_begin()
            if self._timer is None:  # the next request on a kept-alive connection
                self._arm(limits.header_timeout, "headers")

        def on_headers_complete(self) -> None:
            self._disarm()
            if not (hot and self._hot()):
                if hot:
                    self._asgi_scope()
                super().on_headers_complete()
            self._body_due = True  # the body's time starts now: armed after this read, unless it brought it all

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self._body_due:  # a request whose body did not all come with its headers
                self._body_due = False
                self._arm(limits.body_timeout, "body")

        def _asgi_scope(self) -> None:
            """The scope uvicorn makes as a message begins, for the request read so far."""
            url, headers, expect = self.url, self.headers, self.expect_100_continue
            super().on_message_begin()  # (it starts the request afresh: what was read is put back)
            self.url, self.headers, self.expect_100_continue = url, headers, expect
            self.scope["headers"] = headers

        def _hot(self) -> bool:
            """Start a request to one of the door's paths as a WireExchange; False for any other request
            (or one uvicorn must see itself: an upgrade, an escaped path)."""
            path = self.url.partition(b"?")[0]
            parser = self.parser
            if path not in hot or parser.should_upgrade():
                return False
            version = parser.get_http_version()
            exchange = WireExchange(self, parser.get_method().decode("ascii"), path.decode("ascii"), self.headers,
                                    version != "1.0" and parser.should_keep_alive(), self.expect_100_continue)
            existing, self.cycle = self.cycle, exchange  # type: ignore[assignment]
            if existing is None or existing.response_complete:
                if self.expect_100_continue:
                    self._start_asgi_task(exchange, door)  # type: ignore[arg-type]
                else:
                    exchange.early = True  # its task starts with its last byte
            else:  # pipelined behind an answer still going out, as uvicorn queues its own
                self.flow.pause_reading()
                self.pipeline.appendleft((exchange, door))  # type: ignore[arg-type]
            return True

        def on_message_complete(self) -> None:
            self._body_due = False
            self._disarm()
            super().on_message_complete()
            cycle = self.cycle
            if hot and type(cycle) is WireExchange and cycle.early:
                cycle.early = False
                self._start_asgi_task(cycle, door)  # type: ignore[arg-type]

        def on_body(self, body: bytes) -> None:
            super().on_body(body)
            cycle = self.cycle
            if hot and type(cycle) is WireExchange and cycle.early and self.flow.read_paused:
                cycle.early = False  # a body too large to hold: its task reads it (and resumes reading)
                self._start_asgi_task(cycle, door)  # type: ignore[arg-type]

        def _arm(self, seconds: float, phase: str) -> None:
            self._disarm()
            self._timer = self.loop.call_later(seconds, self._too_slow, phase)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _too_slow(self, phase: str) -> None:
            self._timer = None
            if self.transport.is_closing():
                return
            on_cut(f"slow_{phase}")
            cycle = self.cycle  # on a kept-alive connection, the answered request before this one
            if cycle is None or not cycle.response_started or cycle.response_complete:
                seconds = limits.header_timeout if phase == "headers" else limits.body_timeout
                error = RequestTimeout(
                    f"the request's {phase} did not arrive within {seconds:g} s; the connection was closed",
                    phase=phase,
                )
                self.transport.write(raw_error(error))
            self.transport.close()

    return GuardedProtocol
