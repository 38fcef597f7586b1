"""A featureless relay in Python, the floor for bench/relay.py: what the language and its event loop cost.

    python bench/bare_relay.py ENGINE_HOST ENGINE_PORT [--decode]

It does only what any relay must: accept a client (uvloop, httptools), send its request body to the engine
over a kept-alive connection, and write each engine read to the client as it comes (chunked), closing the
engine connection when the client hangs up. No key, no admission, no request ID, no metrics, no log, no
check of what is relayed; with ``--decode``, each read's whole events are decoded into CapyCTL's typed
chunk structs (``domain/relay_check.Head``), the least a relay that checks every chunk has to do.

It prints ``listening on http://127.0.0.1:PORT`` and serves until killed. It is a yardstick, not a product:
it answers nothing but a streamed POST, and trusts the engine's answer.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import httptools
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
         b"connection: close\r\n\r\n")


class Engine(asyncio.Protocol):
    """One kept-alive engine connection; relays the answer to its current client."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.client: asyncio.Transport | None = None
        self.body: list[bytes] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)
        if self.body and self.client is not None:
            self._relay()

    def on_headers_complete(self) -> None:
        if self.client is not None:
            self.client.write(_HEAD)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            if self.body:
                self._write(client)
            client.write(b"0\r\n\r\n")
            client.close()
        self.parser = httptools.HttpResponseParser(self)
        self.relay.idle.append(self)

    def _relay(self) -> None:
        assert self.client is not None
        self._write(self.client)

    def _write(self, client: asyncio.Transport) -> None:
        data = b"".join(self.body)
        self.body.clear()
        decode = self.relay.decode
        if decode is not None and data.startswith(b"data: {"):
            end = data.rfind(b"\n\n")
            try:
                decode(data[6:end].replace(b"\n\ndata: ", b"\n").replace(b"\ndata: [DONE]", b""))
            except Exception:  # noqa: BLE001 - a yardstick: the cost of the decode is what is measured
                pass
        client.write(b"%x\r\n%b\r\n" % (len(data), data))

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.relay.idle:
            self.relay.idle.remove(self)
        if self.client is not None:
            self.client.close()


class Client(asyncio.Protocol):
    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.parser = httptools.HttpRequestParser(self)
        self.body: list[bytes] = []
        self.transport: asyncio.Transport | None = None
        self.engine: Engine | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self.body)
        request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\n"
                   b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
        idle = self.relay.idle
        while idle and (idle[-1].transport is None or idle[-1].transport.is_closing()):
            idle.pop()  # closed meanwhile
        if idle:
            self._send(idle.pop(), request)
        else:  # (the loop keeps only a weak reference to a task: the relay keeps it until it is done)
            task = asyncio.ensure_future(self._connect(request))
            self.relay.connecting.add(task)
            task.add_done_callback(self.relay.connecting.discard)

    async def _connect(self, request: bytes) -> None:
        loop = asyncio.get_running_loop()
        _, engine = await loop.create_connection(lambda: Engine(self.relay), self.relay.host, self.relay.port)
        self._send(engine, request)

    def _send(self, engine: Engine, request: bytes) -> None:
        if self.transport is None or self.transport.is_closing():
            self.relay.idle.append(engine)
            return
        self.engine = engine
        engine.client = self.transport
        assert engine.transport is not None
        engine.transport.write(request)

    def connection_lost(self, exc: Exception | None) -> None:
        engine = self.engine
        if engine is not None and engine.client is self.transport:  # hung up mid-answer: the engine is told
            engine.client = None
            if engine.transport is not None:
                engine.transport.close()
        self.transport = None


class Relay:
    def __init__(self, host: str, port: int, decode: bool) -> None:
        self.host = host
        self.port = port
        self.idle: list[Engine] = []
        self.connecting: set[asyncio.Future[None]] = set()
        self.decode = None
        if decode:
            import msgspec

            from capyctl.domain.relay_check import Head

            self.decode = msgspec.json.Decoder(Head).decode_lines


async def serve(relay: Relay) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Client(relay), "127.0.0.1", 0)
    print(f"listening on http://127.0.0.1:{server.sockets[0].getsockname()[1]}", flush=True)
    await asyncio.Event().wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engine_host")
    parser.add_argument("engine_port", type=int)
    parser.add_argument("--decode", action="store_true", help="decode each chunk into CapyCTL's typed structs")
    args = parser.parse_args()
    uvloop.run(serve(Relay(args.engine_host, args.engine_port, args.decode)))


if __name__ == "__main__":
    main()
