"""CapyCTL's HTTP server over real sockets: connections, limits, what the parser refuses, the ASGI way.

What a client sees of the server itself, whatever the handler: requests the
HTTP parser refuses get the OpenAI error envelope with a request ID and the
connection closed; a body declared past the limit is refused at once; the
header and body timers run only while their part is still to come; a request
to a path without a handler reaches the ASGI application with the
connection's addresses, and each connection answers its own requests.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import msgspec
import pytest

from capyctl.adapters.http.exchange import Exchange
from capyctl.adapters.http.server import Connection, HttpServer
from capyctl.domain.limits import Limits


async def _echo_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    message = await receive()
    answer = json.dumps(
        {
            "path": scope["path"],
            "body": message["body"].decode(),
            "server": list(scope["server"]),
            "client": list(scope["client"]),
            "scheme": scope["scheme"],
            "headers": [[k.decode(), v.decode()] for k, v in scope["headers"]],
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(answer)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": answer})


async def _ok(exchange: Exchange) -> None:
    await exchange.json(200, b'{"handled":true}', [])


class Running:
    """An HttpServer on a free loopback port, in this event loop, stopped on the way out."""

    def __init__(self, limits: Limits = Limits(), keep_alive: float = 5.0) -> None:
        self.cuts: list[str] = []
        self.server = HttpServer({"/v1/chat/completions": _ok}, _echo_app, limits, self.cuts.append, keep_alive)
        self.stopping = asyncio.Event()

    async def __aenter__(self) -> Running:
        import socket

        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        self.port = sock.getsockname()[1]
        self.task = asyncio.create_task(self.server.serve(sock, self.stopping))
        return self

    async def __aexit__(self, *_: object) -> None:
        self.stopping.set()
        await asyncio.wait_for(self.task, 10)

    async def exchange(self, raw: bytes) -> tuple[bytes, bool]:
        """What the server answers to ``raw``, and whether it closed the connection after that."""
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        writer.write(raw)
        answer = await asyncio.wait_for(reader.read(), 10)  # read to EOF: the server must close
        writer.close()
        return answer, True


def _parts(answer: bytes) -> tuple[str, dict[str, str], bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").split("\r\n")
    return status, {k.lower(): v for k, v in (line.split(": ", 1) for line in lines)}, body


CHAT = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
REFUSED = {  # raw requests the HTTP parser refuses, by what is wrong with them
    "bad chunk size": CHAT + b"Transfer-Encoding: chunked\r\n\r\nzz\r\nab\r\n0\r\n\r\n",
    "length and chunked": CHAT + b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
    "two lengths": CHAT + b"Content-Length: 3\r\nContent-Length: 4\r\n\r\nabcd",
    "negative length": CHAT + b"Content-Length: -1\r\n\r\n",
    "bad header name": CHAT + b"Bad Name: x\r\nContent-Length: 0\r\n\r\n",
    "CR in a header": CHAT + b"X-Thing: a\rb\r\nContent-Length: 0\r\n\r\n",
    "bad request line": b"POST /v1/chat/completions HTTP/9\r\n\r\n",
    "DEL in X-Request-Id": CHAT + b"X-Request-Id: ab\x7fcd\r\nContent-Length: 0\r\n\r\n",
}


@pytest.mark.parametrize("case", list(REFUSED))
async def test_a_request_the_parser_refuses_gets_the_envelope_with_an_id_and_the_connection_closed(case: str) -> None:
    async with Running() as running:
        answer, _ = await running.exchange(REFUSED[case])
    status, headers, body = _parts(answer)
    error = msgspec.json.decode(body)["error"]
    assert status == "HTTP/1.1 400 Bad Request" and error["code"] == "invalid_request"
    assert len(headers["x-capyctl-request-id"]) == 26 and headers["connection"] == "close"
    assert headers["content-type"] == "application/json" and int(headers["content-length"]) == len(body)
    assert (error.get("param") == "X-Request-Id") == (case == "DEL in X-Request-Id")
    assert running.cuts == ["invalid_request"]


async def test_a_body_declared_past_the_limit_is_refused_at_once() -> None:
    async with Running(Limits(max_body=1 << 20, body_timeout=600)) as running:
        # the headers only: a server that waited for the 40 MiB would answer after the body timeout (600 s)
        answer, _ = await running.exchange(CHAT + b"Content-Length: 41943040\r\n\r\n")
    status, headers, body = _parts(answer)
    assert status == "HTTP/1.1 413 Request Entity Too Large"
    assert msgspec.json.decode(body)["error"]["code"] == "too_large" and len(headers["x-capyctl-request-id"]) == 26
    assert running.cuts == ["too_large"]


async def test_a_body_declared_past_the_limit_and_sent_with_its_headers_is_refused_and_counted_once() -> None:
    async with Running(Limits(max_body=1000)) as running:
        answer, _ = await running.exchange(CHAT + b"Content-Length: 2000\r\n\r\n" + b"x" * 2000)
    assert _parts(answer)[0] == "HTTP/1.1 413 Request Entity Too Large" and running.cuts == ["too_large"]


async def test_a_body_that_grows_past_the_limit_is_refused_as_it_does() -> None:
    async with Running(Limits(max_body=1000)) as running:
        chunked = CHAT + b"Transfer-Encoding: chunked\r\n\r\n" + b"400\r\n" + b"x" * 1024 + b"\r\n"  # no end
        answer, _ = await running.exchange(chunked)
    assert _parts(answer)[0] == "HTTP/1.1 413 Request Entity Too Large"


async def test_each_connection_answers_its_own_requests_and_an_asgi_request_sees_the_addresses() -> None:
    async with Running() as running:

        async def one(n: int) -> dict[str, Any]:
            reader, writer = await asyncio.open_connection("127.0.0.1", running.port)
            body = f"body {n}".encode()
            writer.write(
                b"POST /c%d?q=1 HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nConnection: close\r\n\r\n%b"
                % (n, len(body), body)
            )
            answer = await asyncio.wait_for(reader.read(), 10)
            seen = json.loads(_parts(answer)[2])
            seen["local"] = list(writer.get_extra_info("sockname"))
            writer.close()
            return seen

        answers = list(await asyncio.gather(*(one(n) for n in range(6))))
        connections = running.server.connections
        for _ in range(200):  # every connection leaves the server's set as it closes
            if not connections:
                break
            await asyncio.sleep(0.01)
        assert not connections
    for n, seen in enumerate(answers):
        assert seen["path"] == f"/c{n}" and seen["body"] == f"body {n}" and seen["scheme"] == "http"
        assert seen["server"] == ["127.0.0.1", running.port] and seen["client"] == seen["local"]
        assert ["content-length", str(len(f"body {n}"))] in seen["headers"]


async def test_past_max_connections_a_new_connection_gets_503_too_many_connections() -> None:
    async with Running(Limits(max_connections=1)) as running:
        first = await asyncio.open_connection("127.0.0.1", running.port)
        answer, _ = await running.exchange(CHAT + b"Content-Length: 0\r\n\r\n")
        first[1].close()
    status, headers, body = _parts(answer)
    assert status == "HTTP/1.1 503 Service Unavailable" and headers["retry-after"] == "1"
    assert msgspec.json.decode(body)["error"]["code"] == "too_many_connections"


class _Wire:
    """A transport that keeps what is written."""

    def __init__(self) -> None:
        self.written = b""
        self.closed = False

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


async def test_the_body_timer_runs_only_while_a_body_is_still_to_come() -> None:
    server = HttpServer(
        {"/v1/chat/completions": _ok}, _echo_app, Limits(header_timeout=10.0, body_timeout=60.0), lambda kind: None
    )
    loop = asyncio.get_running_loop()
    body = b'{"model": "m"}'
    head = CHAT + b"Content-Length: %d\r\n\r\n" % len(body)
    seen: list[Any] = []
    for reads in ([head + body], [head + body[:5], body[5:]]):
        connection = Connection(server)
        connection.connection_made(_Wire())  # type: ignore[arg-type]
        seen.append(round(connection.timer.when() - loop.time()))  # type: ignore[union-attr]  # the headers' time
        for read in reads:
            connection.data_received(read)
            seen.append(None if connection.timer is None else round(connection.timer.when() - loop.time()))
        seen.append(connection.exchange.body if connection.exchange else None)
        connection.connection_lost(None)
    # all at once: no body time left to run; in two reads: the body's time runs until its end
    assert seen == [10, None, body, 10, 60, None, body]
    await asyncio.sleep(0)


async def test_a_paused_write_waits_for_the_client_to_drain() -> None:
    server = HttpServer({}, _echo_app, Limits(), lambda kind: None)
    connection = Connection(server)
    connection.connection_made(_Wire())  # type: ignore[arg-type]
    await asyncio.wait_for(connection.drain(), 1)  # not paused: at once
    connection.pause_writing()
    waiting = asyncio.ensure_future(connection.drain())
    await asyncio.sleep(0)
    assert not waiting.done()
    connection.resume_writing()
    await asyncio.wait_for(waiting, 1)
    connection.connection_lost(None)


async def test_a_kept_alive_connection_left_idle_is_closed_without_an_answer() -> None:
    async with Running(keep_alive=0.2) as running:
        reader, writer = await asyncio.open_connection("127.0.0.1", running.port)
        writer.write(CHAT + b"Content-Length: 0\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200 ") and b"connection: close" not in head
        rest = await asyncio.wait_for(reader.read(), 10)  # EOF once it stood idle: only the answer's body came
        writer.close()
    assert rest == b'{"handled":true}' and running.cuts == []
