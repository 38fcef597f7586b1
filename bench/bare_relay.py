"""A featureless relay in Python, the floor for bench/relay.py: what the language and its event loop cost.

    python bench/bare_relay.py ENGINE_HOST ENGINE_PORT [--decode] [--checks KEY]

It does only what any relay must: accept a client (uvloop, httptools), send its request body to the engine
over a kept-alive connection, and write each engine read to the client as it comes (chunked), closing the
engine connection when the client hangs up. No key, no admission, no request ID, no metrics, no log, no
check of what is relayed; with ``--decode``, each read's whole events are decoded into CapyCTL's typed
chunk structs (``domain/relay_check.Head``), the least a relay that checks every chunk has to do.

With ``--checks KEY`` it also does, in one flat method per request before the engine is asked, the least
of CapyCTL's own front: a ULID for the request (``adapters/http/ids``), the ``Authorization`` key's
SHA-256 compared in constant time with KEY's, the body decoded and its ``model`` and ``stream`` read, a
place taken under a limit of requests in flight (given back when the answer ends), and the model's
name spliced into the engine's body; the answer's head carries the request's ID. A yardstick of what
flat code with those steps costs, against CapyCTL's layered path: not a product, no error answers
(a request that fails a check is closed).

It prints ``listening on http://127.0.0.1:PORT`` and serves until killed. It is a yardstick, not a product:
it answers nothing but a streamed POST, and trusts the engine's answer.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import sys
from pathlib import Path

import httptools
import msgspec
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from capyctl.adapters.http.ids import new_request_id  # noqa: E402
from capyctl.domain.keys import digest  # noqa: E402 - the digest CapyCTL checks keys by

_PREFIX = b"capy_"
_MOST_IN_FLIGHT = 4096  # as CapyCTL in bench/relay.py, a place for every client: the check is what costs

_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n"


class Engine(asyncio.Protocol):
    """One kept-alive engine connection; relays the answer to its current client."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.client: asyncio.Transport | None = None
        self.body: list[bytes] = []
        self.head: bytes | None = None  # the answer's head, when --checks made one for this request

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)
        if self.body and self.client is not None:
            self._relay()

    def on_headers_complete(self) -> None:
        if self.client is not None:
            self.client.write(_HEAD if self.head is None else self.head)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        client, self.client = self.client, None
        self._give_back()
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
            try:  # noqa: SIM105 - a yardstick: what is measured is the decode's cost, not contextlib.suppress's
                decode(data[6:end].replace(b"\n\ndata: ", b"\n").replace(b"\ndata: [DONE]", b""))
            except Exception:
                pass
        client.write(b"%x\r\n%b\r\n" % (len(data), data))

    def _give_back(self) -> None:
        if self.head is not None:  # the place --checks took for this request
            self.head = None
            self.relay.in_flight -= 1

    def connection_lost(self, exc: Exception | None) -> None:
        self._give_back()
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
        self.authorization = b""
        self.head: bytes | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) == 13 and name.lower() == b"authorization":
            self.authorization = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body = b"".join(self.body)
        relay = self.relay
        if relay.checks is not None:  # CapyCTL's least front, flat
            request_id = new_request_id()
            scheme, _, token = self.authorization.partition(b" ")
            given = digest(token[len(_PREFIX) :].decode("latin-1")).encode() if token.startswith(_PREFIX) else b""
            obj = relay.decode_body(body) if scheme.lower() == b"bearer" else None
            # "x": the model bench/relay.py names in what it sends to the floors
            if (
                not hmac.compare_digest(given, relay.checks)
                or not isinstance(obj, dict)
                or obj.get("model") != "x"
                or obj.get("stream") is not True
                or relay.in_flight >= _MOST_IN_FLIGHT
            ):
                assert self.transport is not None
                self.transport.close()
                return
            relay.in_flight += 1
            body = body.replace(b'"model":"x"', b'"model":"engine-x"', 1)
            self.head = _HEAD[:-2] + b"x-capyctl-request-id: %b\r\n\r\n" % request_id.encode()
        request = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%b" % (len(body), body)
        )
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
            if self.head is not None:  # the place --checks took for it
                self.relay.in_flight -= 1
            return
        self.engine = engine
        engine.client = self.transport
        engine.head = self.head
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
    def __init__(self, host: str, port: int, decode: bool, key: str | None = None) -> None:
        self.host = host
        self.port = port
        self.checks = digest(key[len(_PREFIX) :]).encode() if key else None
        self.in_flight = 0
        self.decode_body = msgspec.json.Decoder().decode
        self.idle: list[Engine] = []
        self.connecting: set[asyncio.Future[None]] = set()
        self.decode = None
        if decode:
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
    parser.add_argument(
        "--checks",
        metavar="KEY",
        help="also do the least of CapyCTL's front per request, with this key (capy_...) as the only one let in",
    )
    args = parser.parse_args()
    if args.checks is not None and not args.checks.startswith("capy_"):
        parser.error(f"--checks takes a key that starts with capy_; got {args.checks!r}")
    uvloop.run(serve(Relay(args.engine_host, args.engine_port, args.decode, args.checks)))


if __name__ == "__main__":
    main()
