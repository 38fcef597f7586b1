"""ASGI pieces of the replay engine: a request's connection (hang-ups noticed at once), reading a body,
writing an answer."""

from __future__ import annotations

import asyncio
from typing import Any


class Client:
    """One request's connection: ``gone`` turns true on ``http.disconnect`` and ends any wait at once."""

    __slots__ = ("gone", "_waiter", "_task")

    def __init__(self, receive: Any):
        self.gone = False
        self._waiter: asyncio.Future[None] | None = None
        self._task = asyncio.ensure_future(self._watch(receive))

    async def _watch(self, receive: Any) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass
        self.gone = True
        if self._waiter is not None:
            resolve(self._waiter)

    async def wait(self, future: asyncio.Future[None]) -> bool:
        """Wait for ``future`` or a hang-up; True if the client is gone."""
        if self.gone:
            return True
        self._waiter = future
        try:
            await future
        finally:
            self._waiter = None
        return self.gone

    async def wait_until(self, deadline: float) -> bool:
        loop = asyncio.get_running_loop()
        if deadline <= loop.time() or self.gone:
            return self.gone
        future = loop.create_future()
        timer = loop.call_at(deadline, resolve, future)
        try:
            return await self.wait(future)
        finally:
            timer.cancel()

    def close(self) -> None:
        self._task.cancel()


def resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def pieces(data: bytes, size: int | None) -> list[bytes]:
    if not size or size <= 0 or size >= len(data):
        return [data]
    return [data[i : i + size] for i in range(0, len(data), size)]


async def read_body(receive: Any) -> bytes | None:
    """The whole request body; None if the client hung up first."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body += message.get("body", b"")
        if not message.get("more_body"):
            return bytes(body)


async def answer(
    send: Any, status: int, content_type: bytes | None, body: bytes, more: tuple[tuple[bytes, bytes], ...] = ()
) -> None:
    headers = [(b"content-length", str(len(body)).encode())]
    if content_type is not None:
        headers.append((b"content-type", content_type))
    headers += more
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
