"""A tiny HTTP/1.1 engine on a real socket, answering from a script: the side routes' test double.

Each request takes the next answer queued for its target (path and query as
sent), else the next one queued for any target; an answer marked reusable
answers every such request. Every request is logged (method, target, headers,
body), and so is what happens to the connections: how many were opened, and
how many the client closed. On the way out the script must be used up and no
request may have gone unanswered, as pytest-httpx held it.

How an answer is given (``how``):

- ``whole``: status line, Content-Length, body; the connection stays open;
- ``chunked``: the body in chunks of 7 bytes, Transfer-Encoding: chunked;
- ``cut``: the head and half the body, then the connection is closed;
- ``hang``: the head and half the body, then nothing until the client closes the connection;
- ``close``: the connection is closed at once, without an answer;
- ``stall``: no answer; the connection stays open until the client closes it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import msgspec

from tests.fakes import http1

How = Literal["whole", "chunked", "cut", "hang", "close", "stall"]


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    content_type: str
    how: How
    reusable: bool


@dataclass(frozen=True)
class Sent:
    method: str
    target: str
    headers: dict[str, str]
    body: bytes


class ScriptedEngine:
    """Serves on 127.0.0.1 (a free port) inside ``async with``; ``url`` is its base URL."""

    def __init__(self) -> None:
        self.url = ""
        self.requests: list[Sent] = []
        self.connections = 0  # opened by the client
        self.hung_up = 0  # closed by the client
        self.unanswered: list[Sent] = []  # requests no answer was queued for (they got a 500)
        self._script: dict[str | None, list[Answer]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._server: asyncio.Server | None = None

    def add(
        self,
        target: str | None = None,
        status: int = 200,
        body: bytes = b"",
        *,
        json: Any = None,
        content_type: str = "application/json",
        how: How = "whole",
        reusable: bool = False,
    ) -> None:
        """Queue an answer for ``target`` (None: any target)."""
        if json is not None:
            body = msgspec.json.encode(json)
        self._script.setdefault(target, []).append(Answer(status, body, content_type, how, reusable))

    def sent(self) -> list[tuple[str, str, bytes]]:
        return [(r.method, r.target, r.body) for r in self.requests]

    async def __aenter__(self) -> ScriptedEngine:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        assert self._server is not None
        self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()
        if kind is None:
            left = [(target, a) for target, answers in self._script.items() for a in answers if not a.reusable]
            assert not left, f"answers never asked for: {left}"
            assert not self.unanswered, f"requests with no answer queued: {self.unanswered}"

    def _next(self, target: str) -> Answer | None:
        for key in (target, None):
            answers = self._script.get(key)
            if answers:
                return answers[0] if answers[0].reusable else answers.pop(0)
        return None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self.connections += 1
        conn = http1.Conn(reader, writer, max_body=1 << 20)
        try:
            while await self._answer(conn):
                pass
        except http1.PeerGone:
            self.hung_up += 1
        finally:
            self._tasks.discard(task)
            await conn.close()

    async def _answer(self, conn: http1.Conn) -> bool:
        """Read a request and answer it; False once the connection is to end."""
        message = await conn.read_message()
        if not isinstance(message, tuple):
            if conn.eof:
                self.hung_up += 1
            return False
        method, target, headers, body = message
        sent = Sent(method, target, headers, body)
        self.requests.append(sent)
        answer = self._next(target)
        if answer is None:
            self.unanswered.append(sent)
            await conn.write(b"HTTP/1.1 500 No Answer Queued\r\nContent-Length: 0\r\n\r\n")
            return True
        if answer.how == "close":
            return False
        if answer.how == "stall":
            await conn.until_eof()
            self.hung_up += 1
            return False
        head = f"HTTP/1.1 {answer.status} X\r\nContent-Type: {answer.content_type}\r\n"
        if answer.how == "chunked":
            chunks = [answer.body[i : i + 7] for i in range(0, len(answer.body), 7)]
            framed = b"".join(b"%x\r\n%b\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
            await conn.write(f"{head}Transfer-Encoding: chunked\r\n\r\n".encode() + framed)
            return True
        head += f"Content-Length: {len(answer.body)}\r\n\r\n"
        if answer.how in ("cut", "hang"):
            await conn.write(head.encode() + answer.body[: len(answer.body) // 2])
            if answer.how == "hang":
                await conn.until_eof()
                self.hung_up += 1
            return False
        await conn.write(head.encode() + answer.body)
        return True
