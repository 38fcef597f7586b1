"""The inference port's protocol, connection by connection: what the first connection of a server works out
is shared by the next ones, each of which still parses and answers its own requests; a connection's write
flow control pauses and resumes as uvicorn's does; a request's body timer runs only while its body is
still to come."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import uvicorn
from uvicorn.server import ServerState

from capyctl.adapters.http.protocol import LeanFlowControl, guarded_protocol
from capyctl.domain.limits import Limits


async def _echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    answer = json.dumps({"path": scope["path"], "body": body.decode()}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(answer)).encode())]})
    await send({"type": "http.response.body", "body": answer})


def _request(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


async def _several_connections() -> tuple[list[dict[str, Any]], list[Any]]:
    config = uvicorn.Config(_echo, lifespan="off", log_level="warning", access_log=False)
    config.load()
    state, app_state = ServerState(), {}
    protocol = guarded_protocol(Limits(), lambda kind: None)
    made: list[Any] = []

    def make() -> Any:
        connection = protocol(config=config, server_state=state, app_state=app_state)
        made.append((connection, connection.parser, connection.pipeline))  # (uvicorn drops the parser at the end)
        return connection

    server = await asyncio.get_running_loop().create_server(make, "127.0.0.1", 0)
    host, port = server.sockets[0].getsockname()[:2]
    try:
        async def one(n: int) -> dict[str, Any]:
            reader, writer = await asyncio.open_connection(host, port)
            writer.write(_request(f"/c{n}", f"body {n}".encode()))
            answer = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            return json.loads(answer.split(b"\r\n\r\n", 1)[1])

        answers = [await one(0)] + list(await asyncio.gather(*(one(n) for n in range(1, 6))))
        return answers, made
    finally:
        server.close()
        await server.wait_closed()


def test_each_connection_answers_its_own_requests_and_shares_the_servers_settings() -> None:
    answers, made = asyncio.run(_several_connections())
    assert answers == [{"path": f"/c{n}", "body": f"body {n}"} for n in range(6)]
    assert len(made) == 6
    first = made[0][0]
    for connection, _, _ in made[1:]:  # what is the server's is the first connection's
        assert connection.logger is first.logger and connection.access_logger is first.access_logger
        assert connection.access_log is first.access_log is False
        assert connection.config is first.config and connection.connections is first.connections
        assert connection.loop is first.loop and connection.server_state is first.server_state
    assert len({id(parser) for _, parser, _ in made}) == 6  # and each has its own parser and pipeline
    assert len({id(pipeline) for _, _, pipeline in made}) == 6
    assert not first.connections  # every connection left the server's set as it closed


class _Transport:
    def __init__(self) -> None:
        self.paused = 0
        self.resumed = 0

    def pause_reading(self) -> None:
        self.paused += 1

    def resume_reading(self) -> None:
        self.resumed += 1


def test_flow_control_drains_at_once_until_a_write_pauses_then_waits_for_the_resume() -> None:
    async def scenario() -> list[str]:
        flow = LeanFlowControl(_Transport())  # type: ignore[arg-type]
        seen: list[str] = []
        await asyncio.wait_for(flow.drain(), 1)  # never paused: returns at once
        seen.append("drained before any pause")
        flow.pause_writing()
        flow.pause_writing()  # twice: still one pause
        waiting = asyncio.ensure_future(flow.drain())
        for _ in range(5):
            await asyncio.sleep(0)
        seen.append(f"waiting while paused: {not waiting.done()}")
        flow.resume_writing()
        await asyncio.wait_for(waiting, 1)
        seen.append("drained after the resume")
        flow.resume_writing()  # not paused: nothing happens
        await asyncio.wait_for(flow.drain(), 1)
        flow.pause_reading()
        flow.pause_reading()
        flow.resume_reading()
        transport = flow._transport
        seen.append(f"reading paused {transport.paused} resumed {transport.resumed}")  # type: ignore[attr-defined]
        return seen

    assert asyncio.run(scenario()) == ["drained before any pause", "waiting while paused: True",
                                       "drained after the resume", "reading paused 1 resumed 1"]


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


class _Door:
    endpoints = {"/v1/chat/completions": None}

    def __init__(self) -> None:
        self.begun: list[bytes | None] = []

    def begin(self, exchange: Any) -> None:
        self.begun.append(exchange.body_now(1 << 20))

    async def serve(self, exchange: Any) -> None:
        await exchange.json(200, b"{}", [])


def test_the_body_timer_runs_only_while_a_body_is_still_to_come() -> None:
    limits = Limits(header_timeout=10.0, body_timeout=60.0)

    async def scenario() -> list[Any]:
        config = uvicorn.Config(_echo, lifespan="off", log_level="warning", access_log=False)
        config.load()
        door = _Door()
        protocol = guarded_protocol(limits, lambda kind: None, door)
        loop = asyncio.get_running_loop()
        seen: list[Any] = []
        state, app_state = ServerState(), {}
        body = b'{"model": "m"}'
        head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n").encode()

        whole = protocol(config=config, server_state=state, app_state=app_state)
        whole.connection_made(_Wire())
        seen.append(round(whole._timer.when() - loop.time()))  # the header time, from the connection
        whole.data_received(head + body)  # headers and body in one read
        seen.append(whole._timer)  # nothing left to time
        seen.append(door.begun[-1])

        split = protocol(config=config, server_state=state, app_state=app_state)
        split.connection_made(_Wire())
        split.data_received(head + body[:5])  # the body's start only
        seen.append(round(split._timer.when() - loop.time()))  # the body's time runs
        split.data_received(body[5:])
        seen.append(split._timer)
        seen.append(door.begun[-1])
        for connection in (whole, split):
            connection.connection_lost(None)
        return seen

    assert asyncio.run(scenario()) == [10, None, b'{"model": "m"}', 60, None, b'{"model": "m"}']
