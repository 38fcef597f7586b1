"""The inference port's protocol reads a connection's addresses, and makes uvicorn's ASGI scope, only for a
request that takes the ASGI way: what such a request's scope carries must be what uvicorn's own protocol
would have put there."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import uvicorn
from uvicorn.server import ServerState

from capyctl.adapters.http.protocol import guarded_protocol
from capyctl.domain.limits import Limits


async def _scope_echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
    body = json.dumps({"server": scope["server"], "client": scope["client"], "scheme": scope["scheme"],
                       "path": scope["path"], "headers": [[k.decode(), v.decode()] for k, v in scope["headers"]]}).encode()
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


class _Door:
    """A front door whose path is not the one asked for: the request takes uvicorn's ASGI way."""

    endpoints = {"/v1/chat/completions": None}

    async def serve(self, exchange: Any) -> None:
        raise AssertionError("not the door's path")


async def _answers(door: Any) -> tuple[dict[str, Any], tuple[str, int], tuple[str, int]]:
    config = uvicorn.Config(_scope_echo, lifespan="off", log_level="warning")
    config.load()
    state = ServerState()
    protocol = guarded_protocol(Limits(), lambda kind: None, door)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: protocol(config=config, server_state=state, app_state={}),
                                      "127.0.0.1", 0)
    try:
        reader, writer = await asyncio.open_connection(*server.sockets[0].getsockname()[:2])
        writer.write(b"GET /anything HTTP/1.1\r\nHost: x\r\nX-One: 1\r\nConnection: close\r\n\r\n")
        answer = await asyncio.wait_for(reader.read(), 10)
        mine = writer.get_extra_info("sockname")
        writer.close()
        return json.loads(answer.split(b"\r\n\r\n", 1)[1]), server.sockets[0].getsockname()[:2], mine
    finally:
        server.close()
        await server.wait_closed()


@pytest.mark.parametrize("door", [None, _Door()], ids=["management port", "inference port"])
def test_an_asgi_request_sees_the_connections_addresses_scheme_and_headers(door: Any) -> None:
    scope, listening, client = asyncio.run(_answers(door))
    assert scope == {"server": list(listening), "client": list(client), "scheme": "http", "path": "/anything",
                     "headers": [["host", "x"], ["x-one", "1"], ["connection", "close"]]}
