"""The front door over ASGI, for unit tests: an exchange made of ASGI's receive and send, whose hang-up and
deadline watch is a task beside the request (so it runs under trio's virtual clock too). The server has one
exchange type (``capyctl.adapters.http.exchange.Exchange``); this fake stands in for it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import anyio.abc

from capyctl.adapters.log_format import routine_due
from capyctl.domain.errors import TooLarge

Headers = list[tuple[bytes, bytes]]


class ClientGone(Exception):
    """The client hung up before the body was read."""


def _json_headers(body: bytes, headers: Headers) -> Headers:
    return [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *headers]


def _declared_too_large(headers: Headers, limit: int) -> bool:
    for key, value in headers:
        if key == b"content-length":
            return value.isdigit() and int(value) > limit
    return False


class AsgiExchange:
    """An exchange over ASGI's receive and send; its watch runs in ``tasks``, the request's task group.

    ASGI's ``send`` is awaited, so ``write_now`` (called from a pumped stream's delivery) only queues its
    bytes and says the client is full: the relay then awaits ``drain``, which sends them."""

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
        self._queued: list[bytes] = []

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

    def write_now(self, data: bytes) -> bool:
        if self.ended:
            return False
        self._queued.append(data)
        return True

    async def drain(self) -> None:
        while self._queued:
            await self.write(self._queued.pop(0))

    async def end(self, data: bytes = b"") -> None:
        await self.drain()
        await self._start()
        self.ended = True
        routine_due()
        await self._send({"type": "http.response.body", "body": data, "more_body": False})

    def cut_scope(self) -> anyio.CancelScope:
        return anyio.CancelScope()


class AsgiDoor:
    """``door`` (a ``FrontDoor``) as an ASGI application."""

    def __init__(self, door: Any) -> None:
        self.door = door

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        async with anyio.create_task_group() as tasks:
            exchange = AsgiExchange(scope, receive, send, tasks)
            try:  # (the server reads a request whole before its handler is called)
                exchange.body = await exchange.read_body(1 << 30)
            except ClientGone:
                return
            await self.door.serve(exchange)
            tasks.cancel_scope.cancel()
