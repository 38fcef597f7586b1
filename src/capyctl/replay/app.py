"""The replay engine as a bare ASGI application.

``POST /v1/chat/completions`` serves a recorded case, chosen by optional request fields:
``replay_case`` (which recording), ``replay_chunk_size`` (bytes per write; default one write per
SSE event), ``replay_pace`` (``recorded`` | ``fast``, overriding ``--pace``) and
``replay_interval_ms`` (a fixed wait before the first event and between events, overriding the
pace). Error cases answer their recorded
status and body. A client that hangs up mid-answer is noticed at once (an ``http.disconnect``
watcher) and counted; ``GET /replay/stats`` reports the counts. While the engine "sleeps", chat
requests wait (counted as waiting) until it is woken.

``POST /v1/systemone`` serves the folder's recorded decisions (``decisions.py``), when it has any:
the case's recorded status, headers and body; every request is logged for ``/replay/stats``.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

import msgspec

from capyctl.replay.asgi import Client, answer, pieces, read_body, resolve
from capyctl.replay.assemble import assemble
from capyctl.replay.decisions import DecisionLog
from capyctl.replay.dialects import Dialect
from capyctl.replay.recordings import Case, Recording

_CHAT = "/v1/chat/completions"
_DECIDE = "/v1/systemone"
_JSON = b"application/json"


class ChatRequest(msgspec.Struct):
    stream: bool | None = None
    replay_case: str | None = None
    replay_chunk_size: int | None = None
    replay_pace: str | None = None
    replay_interval_ms: float | None = None


_decode_request = msgspec.json.Decoder(ChatRequest).decode


class ReplayApp:
    def __init__(
        self, recording: Recording, dialect: str, version: str, pace: str = "fast", default_case: str | None = None
    ):
        self.recording = recording
        self.dialect = Dialect(dialect, version, recording.model)
        self.pace = pace
        self.default_case = default_case or recording.default_case()
        if self.default_case not in recording.cases:
            raise ValueError(f"default case {self.default_case!r} is not in {recording.path}")
        self.running = self.waiting = self.completed = self.disconnected = self.requests = 0
        self.last_request: dict[str, Any] = {}  # headers and body of the last chat request, for tests
        # milliseconds from the engine going idle (its last answer sent) to the next chat request's arrival,
        # the last 1,000: with one slot and a queue, CapyCTL's hand-over time to the next waiter
        self.idle_gaps_ms: deque[float] = deque(maxlen=1000)
        self._idle_since: float | None = None
        self.decision_log = DecisionLog()  # every decision request: what reached the engine, for tests
        self._asleep = False
        self._sleepers: set[asyncio.Future[None]] = set()
        stream_type = self.dialect.stream_content_type
        if dialect == "vllm":
            stream_type += b"; charset=utf-8"
        self._stream_headers = [(b"content-type", stream_type), (b"cache-control", b"no-cache")]

    # -- State for the dialects -------------------------------------------------------------------------
    @property
    def sleeping(self) -> bool:
        return self._asleep

    def sleep(self, level: int) -> None:
        self._asleep = True

    def wake(self) -> None:
        self._asleep = False
        for future in self._sleepers:
            resolve(future)

    def stats(self) -> dict[str, Any]:
        return {
            "running": self.running,
            "completed": self.completed,
            "disconnected": self.disconnected,
            "requests": self.requests,
            "last_request": self.last_request,
            "idle_gaps_ms": list(self.idle_gaps_ms),
            "decisions": self.decision_log.stats(),
        }

    # -- ASGI -------------------------------------------------------------------------------------------
    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                kind = (await receive())["type"]
                await send({"type": kind + ".complete"})
                if kind == "lifespan.shutdown":
                    return
        if scope["type"] != "http":
            return
        method, path = scope["method"], scope["path"]
        if path == _CHAT and method == "POST":
            self.last_request["headers"] = [[k.decode("latin-1"), v.decode("latin-1")] for k, v in scope["headers"]]
            await self._chat(receive, send)
            return
        if path == _DECIDE and method == "POST" and self.recording.decisions.cases:
            await self._decide(scope["headers"], receive, send)
            return
        if path == "/replay/stats" and method == "GET":
            await answer(send, 200, _JSON, msgspec.json.encode(self.stats()))
            return
        routed = self.dialect.route(method, path, scope.get("query_string", b""), self)
        if routed is None:
            routed = (404, _JSON, self.dialect.error(404, f"no route {method} {path}"))
        await answer(send, *routed)

    async def _chat(self, receive: Any, send: Any) -> None:
        self.requests += 1
        arrived = time.perf_counter()
        if self.running == 0 and self._idle_since is not None:  # the engine was idle: how long since its last answer
            self.idle_gaps_ms.append((arrived - self._idle_since) * 1000)
            self._idle_since = None
        body = await read_body(receive)
        if body is None:
            self.disconnected += 1
            return
        self.last_request["body"] = body.decode("utf-8", "replace")
        try:
            request = _decode_request(body)
        except msgspec.DecodeError as exc:
            await answer(send, 400, _JSON, self.dialect.error(400, f"invalid request body: {exc}"))
            self.completed += 1
            return
        name = request.replay_case or self.default_case
        case = self.recording.cases.get(name)
        if case is None:
            await answer(send, 404, _JSON, self.dialect.error(404, f"replay case {name!r} not found"))
            self.completed += 1
            return
        if case.kind == "error":
            await answer(send, case.status, case.content_type, case.body)
            self.completed += 1
            return
        client = Client(receive)
        try:
            if await self._wait_awake(client):
                waits = self._waits(request)
                self.running += 1
                try:
                    if request.stream:
                        gone = await self._stream(send, case, request.replay_chunk_size, waits, client)
                    else:
                        gone = await self._whole(send, case, waits, client)
                finally:
                    self.running -= 1
                    if self.running == 0:
                        self._idle_since = time.perf_counter()
            else:
                gone = True
        finally:
            client.close()
        if gone:
            self.disconnected += 1
        else:
            self.completed += 1

    async def _decide(self, headers: list[tuple[bytes, bytes]], receive: Any, send: Any) -> None:
        """The recorded answer to this decision request, once awake; the request is logged first."""
        body = await read_body(receive)
        if body is None:
            return
        case, how = self.recording.decisions.match(body)
        self.decision_log.add(headers, body, case.name if case else None, case.status if case else 404)
        client = Client(receive)
        try:
            if not await self._wait_awake(client):
                return
        finally:
            client.close()
        if case is None:
            await answer(send, 404, _JSON, self.dialect.error(404, how))
            return
        await answer(send, case.status, None, case.body, case.headers)

    def _waits(self, request: ChatRequest) -> tuple[float, float]:
        """(before the first event, between events) in seconds."""
        if request.replay_interval_ms is not None:
            wait = max(request.replay_interval_ms, 0.0) / 1000
            return wait, wait
        if (request.replay_pace or self.pace) == "recorded":
            return self.recording.first_chunk_s, self.recording.interval_s
        return 0.0, 0.0

    async def _wait_awake(self, client: Client) -> bool:
        """False if the client left while the engine slept."""
        if not self._asleep:
            return True
        woken = asyncio.get_running_loop().create_future()
        self._sleepers.add(woken)
        self.waiting += 1
        try:
            return not await client.wait(woken)
        finally:
            self.waiting -= 1
            self._sleepers.discard(woken)

    async def _stream(
        self, send: Any, case: Case, chunk: int | None, waits: tuple[float, float], client: Client
    ) -> bool:
        """Write the case's bytes; True if the client hung up before the last one."""
        await send({"type": "http.response.start", "status": 200, "headers": self._stream_headers})
        first, interval = waits
        paced = first > 0 or interval > 0
        if paced:  # a write never spans two events
            groups = [pieces(e, chunk) for e in case.events]
        else:  # fast: chunks may span events
            groups = [pieces(case.body, chunk)] if chunk else [[e] for e in case.events]
        loop = asyncio.get_running_loop()
        next_at = loop.time() + first
        writes = 0
        for group in groups:
            if paced:  # on a fixed schedule: waits do not add up their overshoot
                if await client.wait_until(next_at):
                    return True
                next_at = max(next_at + interval, loop.time())
            elif client.gone:
                return True
            for piece in group:
                await send({"type": "http.response.body", "body": piece, "more_body": True})
                writes += 1
                if not writes & 63:  # now and then let other streams and the watcher run
                    await asyncio.sleep(0)
                    if client.gone:
                        return True
        if client.gone:
            return True
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return False

    async def _whole(self, send: Any, case: Case, waits: tuple[float, float], client: Client) -> bool:
        """The assembled chat.completion, after the stream's duration when paced."""
        total = waits[0] + waits[1] * max(len(case.events) - 1, 0)
        if await client.wait_until(asyncio.get_running_loop().time() + total):
            return True
        status, body = assemble(case.events)
        await answer(send, status, _JSON, body)
        return False
