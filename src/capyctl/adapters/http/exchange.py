"""One HTTP request and its answer, on a connection of CapyCTL's server (``server.py``).

The front door (``front.FrontDoor``) is written against ``Exchange``: the
request (method, path, headers, its whole body), a watch for the client's
hang-up and a periodic check, and the answer (one JSON body, or a stream of
pieces sent chunked, its headers leaving with its first piece). A request to
a path without a handler of its own is given to an ASGI application over the
same exchange (``run``).

Every answer is HTTP/1.1 with a ``date`` header; a connection that is not to
be kept alive says ``connection: close`` and is closed after the answer. Each
answer hands its request's routine log line out just before its last bytes
(``log_format.routine_due``): the line is in the log by the time the client
has the answer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from email.utils import formatdate
from http import HTTPStatus
from typing import Any

from capyctl.adapters.http.errors import error_body, status_of
from capyctl.adapters.http.ids import new_request_id
from capyctl.adapters.log_format import routine_due
from capyctl.domain.errors import InternalError

Headers = list[tuple[bytes, bytes]]
log = logging.getLogger("capyctl.http")
_STATUS = {status.value: b"HTTP/1.1 %d %b\r\n" % (status.value, status.phrase.encode()) for status in HTTPStatus}


def find_header(headers: Headers, name: bytes) -> str | None:
    for key, value in headers:
        if key == name:
            return value.decode("latin-1")
    return None


def header_values(headers: Headers, name: bytes) -> list[str]:
    return [value.decode("latin-1") for key, value in headers if key == name]


def status_line(status: int) -> bytes:
    return _STATUS.get(status) or b"HTTP/1.1 %d Unknown\r\n" % status


_date: tuple[int, bytes] = (0, b"")


def date_header() -> bytes:
    """``date: ...\\r\\n`` for now, formatted once a second."""
    global _date
    now = int(time.time())
    if _date[0] != now:
        _date = (now, b"date: " + formatdate(now, usegmt=True).encode() + b"\r\n")
    return _date[1]


def raw_error(status: int, body: bytes, retry_after: int | None = None) -> bytes:
    """A whole error answer that closes the connection, with a request ID of its own: for what is refused
    before a request is read whole (limits, a request the parser refuses)."""
    head = [
        status_line(status),
        date_header(),
        b"content-type: application/json\r\n",
        b"content-length: %d\r\n" % len(body),
        b"cache-control: no-store\r\n",
        b"x-capyctl-request-id: %b\r\n" % new_request_id().encode(),
        b"connection: close\r\n",
    ]
    if retry_after is not None:
        head.append(b"retry-after: %d\r\n" % retry_after)
    return b"".join(head) + b"\r\n" + body


class Exchange:
    """One request read whole, and its answer written straight to the connection's transport."""

    def __init__(
        self, connection: Any, method: str, path: str, query: bytes, headers: Headers, body: bytes, keep_alive: bool
    ) -> None:
        self.method = method
        self.path = path
        self.query = query
        self.headers = headers
        self.body = body
        self.keep_alive = keep_alive
        self.started = False  # the status line went out
        self.ended = False  # the whole answer went out
        self.disconnected = False
        self._connection = connection
        self._gone: Callable[[], None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._lost: asyncio.Future[None] | None = None
        self._head = b""

    def begin(self, handler: Callable[[Exchange], Awaitable[None]] | None) -> Awaitable[None]:
        """The handler called (at once: what it does before returning is done before the request's task runs)
        for what the task is to await; with no handler, the server's ASGI application. A handler that raises
        here gets the last resort's answer."""
        if handler is None:
            return _Asgi(self).run(self._connection.server.fallback)
        try:
            return handler(self)
        except Exception:
            log.exception("request %s %s: internal error", self.method, self.path)
            return self._internal_error()

    async def _internal_error(self) -> None:
        error = InternalError(new_request_id())
        await self.json(status_of(error), error_body(error), [(b"cache-control", b"no-store")])

    async def run(self, work: Awaitable[None]) -> None:
        """Await what ``begin`` returned. Whatever escapes is the last resort's: an error answer if none
        began, else the connection is closed."""
        try:
            await work
        except asyncio.CancelledError:  # the server's shutdown, past its grace period
            self._close()
            raise
        except Exception:
            log.exception("request %s %s: internal error", self.method, self.path)
            if not self.started:
                await self._internal_error()
        finally:
            self._stop_timer()
            if not self.ended:  # an answer that cannot be completed: the client must not wait for it
                self._close()
                self._connection.answered(self)

    def lost(self) -> None:
        """The connection is gone (called by the connection)."""
        self.disconnected = True
        if self._gone is not None:
            gone, self._gone = self._gone, None
            self._stop_timer()
            gone()
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(None)

    async def until_lost(self) -> None:
        if not self.disconnected:
            self._lost = asyncio.get_running_loop().create_future()
            await self._lost

    # the watch
    def watch(self, gone: Callable[[], None], every: float, overdue: Callable[[], bool]) -> None:
        """Call ``gone()`` once: when the client hangs up, or when ``overdue()`` (asked every ``every`` s)
        says so. Until ``unwatch``."""
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

    def cut_scope(self) -> TaskCut:
        """A cancel scope for the request's answer (``cancel()``, ``cancelled_caught``): what ``watch``'s
        ``gone`` cancels."""
        return TaskCut()

    # the answer
    def _status_head(self, status: int, headers: Headers) -> list[bytes]:
        content = [status_line(status), date_header()]
        for name, value in headers:
            content += (name, b": ", value, b"\r\n")
        if not self.keep_alive:
            content.append(b"connection: close\r\n")
        return content

    async def _writable(self) -> bool:
        connection = self._connection
        if connection.write_paused and not self.disconnected:
            await connection.drain()
        return not self.disconnected and not self.ended  # nothing may follow an answer's end

    async def json(self, status: int, body: bytes, headers: Headers) -> None:
        """A whole answer: ``body`` as ``application/json`` with its length."""
        await self.whole(
            status, body, [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)), *headers]
        )

    async def whole(self, status: int, body: bytes, headers: Headers) -> None:
        """A whole answer; ``headers`` give its length."""
        if not await self._writable():
            return
        content = self._status_head(status, headers)
        content.append(b"\r\n")
        if self.method != "HEAD":
            content.append(body)
        self.started = True
        routine_due()
        self._connection.transport.write(b"".join(content))
        self._complete()

    def start(self, headers: Headers, status: int = 200) -> None:
        """A streamed answer's headers: they leave with its first piece."""
        content = self._status_head(status, headers)
        content.append(b"transfer-encoding: chunked\r\n\r\n")
        self._head = b"".join(content)

    async def write(self, data: bytes) -> None:
        """The next piece of a started stream."""
        if await self._writable():
            self.write_now(data)

    def write_now(self, data: bytes) -> bool:
        """``write`` at once, from a callback (a pumped stream): True when the client cannot take more for now
        (the caller stops producing until ``drain`` returns)."""
        if self.disconnected or self.ended:  # nothing may follow an answer's end
            return False
        if data or not self.started:
            head = b"" if self.started else self._head
            self.started = True
            self._connection.transport.write(b"%b%x\r\n%b\r\n" % (head, len(data), data) if data else head)
        paused: bool = self._connection.write_paused
        return paused

    async def drain(self) -> None:
        """Return once the client can take more (or is gone)."""
        if self._connection.write_paused and not self.disconnected:
            await self._connection.drain()

    async def end(self, data: bytes = b"") -> None:
        """A stream's last piece (if any) and its end."""
        if not await self._writable():
            return
        head = b"" if self.started else self._head
        self.started = True
        routine_due()
        self._connection.transport.write(
            b"%b%x\r\n%b\r\n0\r\n\r\n" % (head, len(data), data) if data else head + b"0\r\n\r\n"
        )
        self._complete()

    def _complete(self) -> None:
        self.ended = True
        self._connection.answered(self)

    def _close(self) -> None:
        transport = self._connection.transport
        if transport is not None:
            transport.close()


class _Asgi:
    """A request given to an ASGI application: its scope, ``receive`` (the body, then the hang-up) and
    ``send`` (a whole answer when its length is known, else chunked)."""

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange
        self.status = 200
        self.headers: Headers = []
        self.received = False
        self.sized = False

    async def run(self, app: Any) -> None:
        exchange = self.exchange
        transport = exchange._connection.transport
        server = transport.get_extra_info("sockname") if transport is not None else None
        client = transport.get_extra_info("peername") if transport is not None else None
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": exchange.method,
            "scheme": "http",
            "path": exchange.path,
            "raw_path": exchange.path.encode(),
            "query_string": exchange.query,
            "root_path": "",
            "headers": exchange.headers,
            "server": tuple(server[:2]) if server else None,
            "client": tuple(client[:2]) if client else None,
            "state": {},
        }
        await app(scope, self.receive, self.send)

    async def receive(self) -> dict[str, Any]:
        if not self.received:
            self.received = True
            return {"type": "http.request", "body": self.exchange.body, "more_body": False}
        await self.exchange.until_lost()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        exchange = self.exchange
        if message["type"] == "http.response.start":
            self.status = message["status"]
            self.headers = [(bytes(name).lower(), bytes(value)) for name, value in message.get("headers", ())]
            self.sized = any(name == b"content-length" for name, _ in self.headers)
            return
        body, more = message.get("body", b""), message.get("more_body", False)
        if not exchange.started and not more and not self.sized:  # the whole answer at once
            await exchange.whole(self.status, body, [*self.headers, (b"content-length", b"%d" % len(body))])
        elif self.sized:  # the application gave the length: its bytes as they come
            await self._sized(body, more)
        else:
            if not exchange.started:
                exchange.start(self.headers, self.status)
            await (exchange.write(body) if more else exchange.end(body))

    async def _sized(self, body: bytes, more: bool) -> None:
        exchange = self.exchange
        if not await exchange._writable():
            return
        data = body if exchange.method != "HEAD" else b""
        if not exchange.started:
            content = exchange._status_head(self.status, self.headers)
            content.append(b"\r\n")
            data = b"".join(content) + data
            exchange.started = True
        if not more:
            routine_due()
        exchange._connection.transport.write(data)
        if not more:
            exchange._complete()


class TaskCut:
    """anyio's CancelScope, as far as the front door uses it, for a request's task (always asyncio here): a
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

    def __enter__(self) -> TaskCut:
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
