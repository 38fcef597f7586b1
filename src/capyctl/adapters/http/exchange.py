"""One HTTP request and its answer, as the front door sees it: on the wire, or over ASGI.

The front door (``chat.FrontDoor``) is written once against ``Exchange``.
Two kinds exist:

- ``WireExchange``: the inference port's hot paths. uvicorn's httptools
  protocol parses the request; instead of an ASGI cycle (a scope, message
  dicts, a receive/send pair and a task group per request) it gets this
  object, which writes the answer straight to the connection: a stream's
  headers leave with its first chunk in one write, the client's hang-up
  arrives as a call from the protocol's ``connection_lost``, and the
  deadline watch is a timer, not a task.
- ``AsgiExchange``: the same over any ASGI server (and the unit tests),
  with the hang-up and deadline watch as a task beside the request.

Both answer exactly alike: the same status lines and headers as uvicorn
writes them (its ``date`` and ``server`` headers included), chunked streams,
keep-alive. Both hand a request's routine log line out just before its
answer's last bytes (``log_format.routine_due``): the line is in the log by the
time the client has the answer, as it was when every line woke the writer.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import anyio
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from capyctl.adapters.log_format import routine_due
from capyctl.domain.errors import TooLarge

Headers = list[tuple[bytes, bytes]]
log = logging.getLogger("capyctl.http")


class ClientGone(Exception):
    """The client hung up before CapyCTL answered."""


def find_header(headers: Headers, name: bytes) -> str | None:
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None


def header_values(headers: Headers, name: bytes) -> list[str]:
    return [value.decode("latin-1") for key, value in headers if key == name]


def _declared_too_large(headers: Headers, limit: int) -> bool:
    declared = find_header(headers, b"content-length")
    return declared is not None and declared.isdigit() and int(declared) > limit


class Exchange:
    """What the front door needs of one request: its method, headers and body, a watch for the client's
    hang-up (and a periodic check), and the answer: one JSON body, or a stream of pieces."""

    method: str
    path: str
    headers: Headers
    started: bool  # the status line went out
    ended: bool  # the whole answer went out
    async def read_body(self, limit: int) -> bytes:
        """The whole request body; ``TooLarge`` past ``limit`` bytes, ``ClientGone`` if the client left."""
        raise NotImplementedError

    def watch(self, gone: Callable[[], None], every: float, overdue: Callable[[], bool]) -> None:
        """Call ``gone()`` once: when the client hangs up, or when ``overdue()`` (asked every ``every`` s)
        says so. Until ``unwatch``."""
        raise NotImplementedError

    def unwatch(self) -> None:
        raise NotImplementedError

    def cut_scope(self) -> Any:
        """A cancel scope for the request's answer (``cancel()``, ``cancelled_caught``): what ``watch``'s
        ``gone`` cancels."""
        return anyio.CancelScope()

    async def json(self, status: int, body: bytes, headers: Headers) -> None:
        """A whole answer: ``body`` as ``application/json`` with its length."""
        raise NotImplementedError

    def start(self, headers: Headers) -> None:
        """A 200 stream's headers: they leave with its first piece."""
        raise NotImplementedError

    async def write(self, data: bytes) -> None:
        """The next piece of a started stream."""
        raise NotImplementedError

    async def end(self, data: bytes = b"") -> None:
        """A stream's last piece (if any) and its end."""
        raise NotImplementedError

    async def drain(self) -> None:
        """Return once the client can take more (or is gone)."""


def _json_headers(body: bytes, headers: Headers) -> Headers:
    return [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]


class AsgiExchange(Exchange):
    """An exchange over ASGI's receive and send; its watch runs in ``tasks``, the request's task group."""

    def __init__(self, scope: dict[str, Any], receive: Any, send: Any, tasks: anyio.abc.TaskGroup) -> None:
        self.method = scope["method"]
        self.path = scope["path"]
        self.headers = scope["headers"]
        self.started = False
        self.ended = False
        self._scope = scope
        self._receive = receive
        self._send = send
        self._tasks = tasks
        self._watching: anyio.CancelScope | None = None
        self._head: Headers | None = None

    async def read_body(self, limit: int) -> bytes:
        if _declared_too_large(self.headers, limit):
            raise TooLarge(limit)
        parts: list[bytes] = []
        size = 0
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                raise ClientGone()
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                raise TooLarge(limit)
            parts.append(body)
            if not message.get("more_body", False):
                return b"".join(parts)

    def watch(self, gone: Callable[[], None], every: float, overdue: Callable[[], bool]) -> None:
        self._watching = scope = anyio.CancelScope()

        async def watcher() -> None:
            with scope:
                # the body was read already: the only message receive can still bring is the disconnect
                while True:
                    with anyio.move_on_after(every):
                        if (await self._receive())["type"] == "http.disconnect":
                            break
                    if overdue():
                        break
                gone()

        self._tasks.start_soon(watcher)

    def unwatch(self) -> None:
        if self._watching is not None:
            self._watching.cancel()
            self._watching = None

    async def json(self, status: int, body: bytes, headers: Headers) -> None:
        self.started = True
        await self._send({"type": "http.response.start", "status": status, "headers": _json_headers(body, headers)})
        self.ended = True
        routine_due()
        await self._send({"type": "http.response.body", "body": body})

    def start(self, headers: Headers) -> None:
        self._head = headers

    async def _start(self) -> None:
        if not self.started:
            self.started = True
            await self._send({"type": "http.response.start", "status": 200, "headers": self._head or []})

    async def write(self, data: bytes) -> None:
        await self._start()
        await self._send({"type": "http.response.body", "body": data, "more_body": True})

    async def end(self, data: bytes = b"") -> None:
        await self._start()
        self.ended = True
        routine_due()
        await self._send({"type": "http.response.body", "body": data, "more_body": False})


class _Signal:
    """What uvicorn's protocol calls ``message_event``: it sets it when body bytes arrive, when the body
    is complete and when the connection is lost."""

    __slots__ = ("_exchange",)

    def __init__(self, exchange: WireExchange) -> None:
        self._exchange = exchange

    def set(self) -> None:
        self._exchange.signalled()


class WireExchange(Exchange):
    """One request on a connection of uvicorn's httptools protocol, answered straight on the transport.

    It stands where uvicorn keeps its ``RequestResponseCycle`` (``protocol.cycle``) and has the attributes
    the protocol reads and writes there: ``body``, ``more_body``, ``message_event``, ``disconnected``,
    ``keep_alive``, ``response_started``, ``response_complete``, and ``run_asgi`` (how the protocol
    starts a request, pipelined ones included).
    """

    def __init__(self, protocol: Any, method: str, path: str, headers: Headers, keep_alive: bool,
                 expect_continue: bool) -> None:
        self.method = method
        self.path = path
        self.headers = headers
        self.started = False
        self.ended = False
        self.keep_alive = keep_alive
        self.body = bytearray()  # the protocol appends each piece of the body here
        self.more_body = True
        self.disconnected = False
        self.message_event = _Signal(self)
        self._protocol = protocol
        self._transport: asyncio.Transport = protocol.transport
        self._flow = protocol.flow
        self._expect_continue = expect_continue
        self._waiter: asyncio.Future[None] | None = None
        self._gone: Callable[[], None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._head: bytes = b""
        self.on_response: Callable[[], None] = protocol.on_response_complete
        self.early = False  # its task waits for the request's last byte

    # uvicorn's names for what it reads on its cycle
    @property
    def response_started(self) -> bool:
        return self.started

    @property
    def response_complete(self) -> bool:
        return self.ended

    def signalled(self) -> None:
        if self.disconnected and self._gone is not None:
            gone, self._gone = self._gone, None
            self._stop_timer()
            gone()
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def run_asgi(self, door: Any) -> None:
        """Serve this request with ``door`` (``FrontDoor.serve``): called by the protocol as it would run an
        ASGI app. Whatever escapes closes the connection rather than leaving the client waiting."""
        self.early = False
        try:
            await door.serve(self)
        except asyncio.CancelledError:  # the server's shutdown, past its grace period
            self._transport.close()
            raise
        except Exception:  # the front door's own last resort failed: no answer can be trusted to follow
            log.exception("the hot path let an error escape; the connection was closed")
            self._transport.close()
        finally:
            self.on_response = _nothing
            self._stop_timer()
        if not self.ended and not self.disconnected:  # the front door always answers: never expected
            self._transport.close()

    # the request
    async def read_body(self, limit: int) -> bytes:
        if _declared_too_large(self.headers, limit):
            raise TooLarge(limit)
        if self._expect_continue and not self._transport.is_closing():
            self._expect_continue = False
            self._transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        while self.more_body and not self.disconnected:
            if len(self.body) > limit:
                raise TooLarge(limit)
            self._flow.resume_reading()  # the protocol pauses reading past 64 KiB not yet taken
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        # read on (the protocol paused past 64 KiB of body): a hang-up shows only on a connection being read
        self._flow.resume_reading()
        if self.disconnected:
            raise ClientGone()
        if len(self.body) > limit:
            raise TooLarge(limit)
        body = bytes(self.body)
        self.body = bytearray()
        return body

    # the watch
    def watch(self, gone: Callable[[], None], every: float, overdue: Callable[[], bool]) -> None:
        if self.disconnected:
            gone()
            return
        self._gone = gone
        loop = asyncio.get_running_loop()

        def tick() -> None:
            if self._gone is None:
                return
            if overdue():
                gone, self._gone = self._gone, None
                self._timer = None
                gone()
            else:
                self._timer = loop.call_later(every, tick)

        self._timer = loop.call_later(every, tick)

    def unwatch(self) -> None:
        self._gone = None
        self._stop_timer()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def cut_scope(self) -> _TaskCut:
        return _TaskCut()

    # the answer
    def _status_head(self, status: int, headers: Headers) -> list[bytes]:
        content = [STATUS_LINE[status]]
        for name, value in self._protocol.server_state.default_headers:  # date and server, as uvicorn sends
            content += (name, b": ", value, b"\r\n")
        for name, value in headers:
            content += (name, b": ", value, b"\r\n")
        if not self.keep_alive:
            content.append(b"connection: close\r\n")
        return content

    async def _writable(self) -> bool:
        if self._flow.write_paused and not self.disconnected:
            await self._flow.drain()
        return not self.disconnected and not self.ended  # nothing may follow an answer's end

    async def json(self, status: int, body: bytes, headers: Headers) -> None:
        if not await self._writable():
            return
        content = self._status_head(status, _json_headers(body, headers))
        content.append(b"\r\n")
        if self.method != "HEAD":
            content.append(body)
        self.started = True
        routine_due()
        self._transport.write(b"".join(content))
        self._complete()

    def start(self, headers: Headers) -> None:
        content = self._status_head(200, headers)
        content.append(b"transfer-encoding: chunked\r\n\r\n")
        self._head = b"".join(content)

    async def write(self, data: bytes) -> None:
        if await self._writable():
            self._put(data)

    async def drain(self) -> None:
        if self._flow.write_paused and not self.disconnected:
            await self._flow.drain()

    def _put(self, data: bytes) -> None:
        if not self.started:
            self.started = True
            self._transport.write(b"%b%x\r\n%b\r\n" % (self._head, len(data), data) if data else self._head)
        elif data:
            self._transport.write(b"%x\r\n%b\r\n" % (len(data), data))

    async def end(self, data: bytes = b"") -> None:
        if not await self._writable():
            return
        head = b"" if self.started else self._head
        self.started = True
        routine_due()
        self._transport.write(b"%b%x\r\n%b\r\n0\r\n\r\n" % (head, len(data), data) if data else head + b"0\r\n\r\n")
        self._complete()

    def _complete(self) -> None:
        self.ended = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        if not self.keep_alive:
            self._transport.close()
        self.on_response()


def _nothing() -> None:
    pass


class _TaskCut:
    """anyio's CancelScope, as far as the front door uses it, for a request on the wire (always asyncio): a
    fraction of its cost on a path every request takes.

    ``cancel()`` cancels the request's task once, while it is inside the block (from a callback: at once;
    from the task itself: at its next turn, as a checkpoint would); leaving the block takes back that
    cancellation, and swallows the CancelledError it raised (``cancelled_caught``). Any other
    cancellation (the server's shutdown) goes through.
    """

    __slots__ = ("_task", "_inside", "_called", "_delivered", "cancelled_caught")

    def __init__(self) -> None:
        self._task: asyncio.Task[Any] | None = None
        self._inside = False
        self._called = False
        self._delivered = False  # the task was told (task.cancel()): leaving takes that back
        self.cancelled_caught = False

    def __enter__(self) -> _TaskCut:
        self._task = asyncio.current_task()
        self._inside = True
        return self

    def cancel(self) -> None:
        if not self._inside or self._called or self._task is None:
            return
        self._called = True
        if asyncio.current_task() is self._task:  # from the task itself: when it next yields
            asyncio.get_running_loop().call_soon(self._deliver)
        else:
            self._deliver()

    def _deliver(self) -> None:
        if self._inside and self._task is not None:  # (a block that ended first has nothing to cancel)
            self._delivered = True
            self._task.cancel()

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: Any) -> bool:
        self._inside = False
        if not self._delivered or self._task is None:
            return False
        if self._task.uncancel() == 0 and kind is not None and issubclass(kind, asyncio.CancelledError):
            self.cancelled_caught = True
            return True
        return False
