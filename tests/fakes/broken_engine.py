"""A stand-in engine that misbehaves on purpose, on raw asyncio streams.

``python -m tests.fakes.broken_engine --port 0`` prints one line,
``broken engine listening on http://127.0.0.1:PORT``, then serves until
SIGTERM. It speaks HTTP/1.1 by hand (no HTTP framework) so that it can go
wrong at the byte level: drop a connection before its headers, end a stream
without ``[DONE]``, send one event that never ends, hold a request forever.

``POST /v1/chat/completions`` picks its behaviour from the body field
``broken_case`` (default ``ok``; see ``CASES``). The side routes a healthy
engine has (``/health``, ``/version``, ``/metrics``, ``/props``) answer like
one, each with ``connection: close`` so that CapyCTL's health checks never
linger as open connections. ``GET /broken/stats`` reports what tests assert
on:

- ``requests``: chat requests received, ``by_case``: per case name;
- ``open``: connections that have carried a chat request and are still open
  (whether CapyCTL closes what it must);
- ``held``: ``hold_headers`` requests waiting for their client to give up;
- ``closed_by_peer``: connections the peer closed while a request on them was
  unanswered or mid-answer.

While a case runs, a watcher reads the connection, so that a peer that hangs
up is noticed at once (end of file), without polling, whatever the case is
doing (sleeping, holding, writing).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import select
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec

from tests.fakes import http1
from tests.fakes.http1 import READ as _READ
from tests.fakes.http1 import PeerGone

_encode = msgspec.json.encode
_MAX_BODY = 16 * 1024 * 1024
_JSON = "application/json"
_SSE = "text/event-stream"
_CHAT = "/v1/chat/completions"
_HUGE = 16 * 1024 * 1024
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 413: "Payload Too Large"}


class Stats:
    def __init__(self) -> None:
        self.requests = 0
        self.open = 0
        self.held = 0
        self.closed_by_peer = 0
        self.by_case: Counter[str] = Counter()

    def as_json(self) -> bytes:
        return _encode(
            {
                "requests": self.requests,
                "open": self.open,
                "held": self.held,
                "closed_by_peer": self.closed_by_peer,
                "by_case": dict(self.by_case),
            }
        )


class Request(msgspec.Struct):
    method: str
    path: str
    headers: dict[str, str]
    body: bytes

    @property
    def keep_alive(self) -> bool:
        return self.headers.get("connection", "").lower() != "close"


class Conn(http1.Conn):
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        super().__init__(reader, writer, _MAX_BODY)

    async def read_request(self) -> Request | None:
        """The next request, or None when the peer closed (or sent something unreadable)."""
        message = await self.read_message()
        if not isinstance(message, tuple):
            return None  # a chunked body: CapyCTL frames its requests with Content-Length, nothing else is expected
        method, target, headers, body = message
        return Request(method, target.split("?", 1)[0], headers, body)


def content_length(headers: dict[str, str]) -> int | None:
    """The body's length, None for a value this engine will not read."""
    try:
        length = int(headers.get("content-length", "0") or 0)
    except ValueError:
        return None
    return length if 0 <= length <= _MAX_BODY else None


# -- HTTP and SSE framing ------------------------------------------------------------------------------
def head(status: int, content_type: str, *, length: int | None = None, close: bool = False) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}", f"content-type: {content_type}"]
    lines.append(f"content-length: {length}" if length is not None else "transfer-encoding: chunked")
    if close:
        lines.append("connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def whole(status: int, content_type: str, body: bytes, close: bool = False) -> bytes:
    return head(status, content_type, length=len(body), close=close) + body


def chunk(data: bytes) -> bytes:
    return f"{len(data):x}\r\n".encode() + data + b"\r\n"


_LAST_CHUNK = b"0\r\n\r\n"
_DONE = b"data: [DONE]\n\n"


def event(obj: Any) -> bytes:
    return b"data: " + _encode(obj) + b"\n\n"


def error_envelope(message: str, kind: str, code: str, **extra: Any) -> bytes:
    return _encode({"error": {"message": message, "type": kind, "code": code, **extra}})


# -- vLLM-shaped chunks --------------------------------------------------------------------------------
def chunk_obj(**fields: Any) -> dict[str, Any]:
    return {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "broken", **fields}


def choice(delta: Any, finish_reason: str | None = None, **extra: Any) -> dict[str, Any]:
    return chunk_obj(choices=[{"index": 0, "delta": delta, "finish_reason": finish_reason, **extra}])


ROLE = choice({"role": "assistant", "content": ""}, logprobs=None)
WORDS = ("Hello", " there", "!")
FINISH = choice({"content": ""}, "stop", logprobs=None, stop_reason=None)
USAGE = chunk_obj(choices=[], usage={"prompt_tokens": 5, "total_tokens": 8, "completion_tokens": 3})


def tool_call(index: Any) -> dict[str, Any]:
    return {"index": index, "id": "c1", "type": "function", "function": {"name": "f", "arguments": ""}}


# One malformed event each, sent after a valid role chunk.
MALFORMED: dict[str, dict[str, Any]] = {
    "choices_string": chunk_obj(choices="abc"),
    "choices_number": chunk_obj(choices=7),
    "choice_null": chunk_obj(choices=[None]),
    "choice_string": chunk_obj(choices=["x"]),
    "delta_string": choice("hi"),
    "delta_list": choice(["hi"]),
    "tool_index_string": choice({"tool_calls": [tool_call("0")]}),
    "tool_index_negative": choice({"tool_calls": [tool_call(-1)]}),
    "tool_index_huge": choice({"tool_calls": [tool_call(10_000_000)]}),
    "tool_calls_not_list": choice({"tool_calls": {"index": 0}}),
}


# -- cases: each answers one chat request; True keeps the connection for the next ----------------------
Case = Callable[["Engine", Conn, dict[str, Any]], Awaitable[bool]]


async def stream(conn: Conn, events: list[bytes], end: bytes = _LAST_CHUNK) -> None:
    """A 200 SSE answer in chunked framing, one HTTP chunk per event, ended by ``end``."""
    await conn.write(head(200, _SSE))
    for data in events:
        await conn.write(chunk(data))
    if end:
        await conn.write(end)


def text_events() -> list[bytes]:
    return [event(ROLE), *(event(choice({"content": word})) for word in WORDS)]


async def case_ok(engine: Engine, conn: Conn, body: dict[str, Any]) -> bool:
    delay = body.get("broken_delay_ms")
    if isinstance(delay, int | float) and delay > 0:
        await asyncio.sleep(delay / 1000)  # the watcher notices a client that leaves meanwhile
    events = [*text_events(), event(FINISH)]
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage"):
        events.append(event(USAGE))
    await stream(conn, [*events, _DONE])
    return True


def malformed(obj: dict[str, Any]) -> Case:
    async def case(engine: Engine, conn: Conn, body: dict[str, Any]) -> bool:
        await stream(conn, [event(ROLE), event(obj), _DONE])
        return True

    return case


async def case_html_200(engine: Engine, conn: Conn, body: dict[str, Any]) -> bool:
    page = b"<!doctype html><html><head><title>Welcome</title></head><body><h1>It works!</h1></body></html>\n"
    await conn.write(whole(200, "text/html; charset=utf-8", page))
    return True


async def case_empty_200(engine: Engine, conn: Conn, body: dict[str, Any]) -> bool:
    await conn.write(whole(200, _SSE, b""))
    return True


async def case_json_200(engine: Engine, conn: Conn, body: dict[str, Any]) -> bool:
    """An engine that ignores ``stream: true`` and answers one whole completion."""
    answer = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "broken",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello there!"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "total_tokens": 8, "completion_tokens": 3},
    }
    await conn.write(whole(200, _JSON, _encode(answer)))
    return True


async def case_no_done(engine: Engine, conn: Conn, body: dict[str, Any]) -> bool:
    await stream(conn, text_events())
    return True


async def case_no_done_close(engine: Engine, conn: Conn, body: dict[str, Any]) -> bool:
    await stream(conn, text_events(), end=b"")
    return False


async def case_huge_event(engine: Engine, conn: Conn, body: dict[str, Any]) -> bool:
    """One event that never ends: 16 MiB of ``a`` inside a JSON string, then the connection closes."""
    await conn.write(head(200, _SSE))
    await conn.write(chunk(b'data: {"choices":[{"index":0,"delta":{"content":"'))
    block = chunk(b"a" * _READ)
    for _ in range(_HUGE // _READ):
        await conn.write(block)  # raises PeerGone once the peer has closed
    return False


async def case_error_with_code(engine: Engine, conn: Conn, body: dict[str, Any]) -> bool:
    error = error_envelope(
        "This model's maximum context length is 4096 tokens",
        "invalid_request_error",
        "context_length_exceeded",
        param="messages",
    )
    await conn.write(whole(400, _JSON, error))
    return True


async def case_midstream_error(engine: Engine, conn: Conn, body: dict[str, Any]) -> bool:
    failure = b"data: " + error_envelope("engine overloaded", "server_error", "engine_overloaded") + b"\n\n"
    await stream(conn, [event(ROLE), event(choice({"content": WORDS[0]})), failure, _DONE])
    return True


async def case_hold_headers(engine: Engine, conn: Conn, body: dict[str, Any]) -> bool:
    """Send nothing, ever: only the peer closing ends this request (the watcher cancels it)."""
    engine.stats.held += 1
    try:
        await asyncio.get_running_loop().create_future()
    finally:
        engine.stats.held -= 1
    return False


async def case_close_before_headers(engine: Engine, conn: Conn, body: dict[str, Any]) -> bool:
    return False


CASES: dict[str, Case] = {
    "ok": case_ok,
    **{name: malformed(obj) for name, obj in MALFORMED.items()},
    "html_200": case_html_200,
    "empty_200": case_empty_200,
    "json_200": case_json_200,
    "no_done": case_no_done,
    "no_done_close": case_no_done_close,
    "huge_event": case_huge_event,
    "error_with_code": case_error_with_code,
    "midstream_error": case_midstream_error,
    "hold_headers": case_hold_headers,
    "close_before_headers": case_close_before_headers,
}


# -- side routes: what CapyCTL's health checks and version probe read ----------------------------------
_METRICS = (
    b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 0\n"
    b"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 0\n"
)
SIDE_ROUTES: dict[str, tuple[str, bytes]] = {
    "/health": (_JSON, b'{"status":"ok"}'),
    "/version": (_JSON, b'{"version":"0.32.0"}'),
    "/props": (_JSON, b'{"build_info":"b0-unknown"}'),
    "/metrics": ("text/plain; version=0.0.4; charset=utf-8", _METRICS),
}


class Engine:
    def __init__(self) -> None:
        self.stats = Stats()
        self.tasks: set[asyncio.Task[Any]] = set()  # one per connection, cancelled on SIGTERM

    async def shutdown(self) -> None:
        """End every connection, held ones included: nothing else would end them."""
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def serve_connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = Conn(reader, writer)
        counted = False
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        try:
            while (request := await conn.read_request()) is not None:
                if request.path != _CHAT:
                    await self.side_route(conn, request)
                    return
                if not counted:
                    counted = True
                    self.stats.open += 1
                if not await self.chat(conn, request) or not request.keep_alive:
                    return
        except PeerGone:
            pass
        finally:
            self.tasks.discard(task)
            if counted:
                self.stats.open -= 1
            await conn.close()

    async def side_route(self, conn: Conn, request: Request) -> None:
        """Answer once and close: probes must not show as connections CapyCTL left open."""
        if request.method != "GET":
            answer = whole(405, _JSON, error_envelope("use GET", "invalid_request_error", "method_not_allowed"), True)
        elif request.path == "/broken/stats":
            answer = whole(200, _JSON, self.stats.as_json(), close=True)
        elif request.path in SIDE_ROUTES:
            answer = whole(200, *SIDE_ROUTES[request.path], close=True)
        else:
            answer = whole(404, _JSON, error_envelope(f"no route {request.path}", "not_found", "not_found"), True)
        await conn.write(answer)

    async def chat(self, conn: Conn, request: Request) -> bool:
        """Run the request's case while watching for the peer's hang-up; True keeps the connection."""
        if request.method != "POST":
            refusal = error_envelope("use POST", "invalid_request_error", "method_not_allowed")
            await conn.write(whole(405, _JSON, refusal))
            return True
        self.stats.requests += 1
        try:
            body = msgspec.json.decode(request.body)
        except msgspec.DecodeError:
            body = None
        if not isinstance(body, dict):
            self.stats.by_case["invalid"] += 1
            await conn.write(
                whole(
                    400,
                    _JSON,
                    error_envelope("the body must be a JSON object", "invalid_request_error", "invalid_json"),
                )
            )
            return True
        name = body.get("broken_case", "ok")
        case = CASES.get(name) if isinstance(name, str) else None
        if case is None:
            self.stats.by_case["unknown"] += 1
            await conn.write(
                whole(
                    400, _JSON, error_envelope(f"unknown broken_case {name!r}", "invalid_request_error", "unknown_case")
                )
            )
            return True
        self.stats.by_case[name] += 1
        return await self.watched(case(self, conn, body), conn)

    async def watched(self, answer: Awaitable[bool], conn: Conn) -> bool:
        """Run ``answer``, cut short (and counted) if the peer closes the connection meanwhile."""
        task = asyncio.ensure_future(answer)
        watcher = asyncio.ensure_future(conn.until_eof())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()
            watcher.cancel()
            await asyncio.gather(task, watcher, return_exceptions=True)
        if not task.cancelled() and task.exception() is None:
            return task.result()
        if task.cancelled() or isinstance(task.exception(), PeerGone):
            self.stats.closed_by_peer += 1
            return False
        raise task.exception()  # type: ignore[misc]


async def serve(host: str, port: int) -> None:
    engine = Engine()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    server = await asyncio.start_server(engine.serve_connection, host, port, backlog=4096)
    bound = server.sockets[0].getsockname()[1]
    print(f"broken engine listening on http://{host}:{bound}", flush=True)
    await stop.wait()
    server.close()
    await engine.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="broken_engine", description=__doc__.split("\n", 1)[0])
    parser.add_argument("--port", type=int, required=True, help="0: pick a free port (printed on start)")
    args = parser.parse_args(argv)
    asyncio.run(serve("127.0.0.1", args.port))
    return 0


# -- for tests: the engine as a child process ----------------------------------------------------------
_LISTENING = re.compile(rb"broken engine listening on (http://\S+)")
_REPO = Path(__file__).resolve().parents[2]


class BrokenEngine:
    """``python -m tests.fakes.broken_engine`` as a child process; ``stop`` always ends it."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self.url = ""

    def start(self, timeout: float = 15.0) -> BrokenEngine:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.fakes.broken_engine", "--port", "0"], cwd=_REPO, stdout=subprocess.PIPE
        )
        assert self.process.stdout is not None
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)  # a hung start must not hang the suite
        line = self.process.stdout.readline() if ready else b""
        match = _LISTENING.search(line)
        if match is None:
            self.stop()
            raise RuntimeError(f"the broken engine did not start within {timeout} s: {line!r}")
        self.url = match.group(1).decode()
        return self

    def stats(self) -> dict[str, Any]:
        return httpx.get(self.url + "/broken/stats", timeout=5).json()

    def wait_for(self, done: Callable[[dict[str, Any]], bool], timeout: float = 5.0) -> dict[str, Any]:
        """Poll the stats every 20 ms until ``done`` holds or ``timeout`` passes; the last stats either way."""
        deadline = time.monotonic() + timeout
        while not done(stats := self.stats()) and time.monotonic() < deadline:
            time.sleep(0.02)
        return stats

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


if __name__ == "__main__":
    sys.exit(main())
