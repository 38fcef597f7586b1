"""A host's ingress (``start host --ingress-listen``, 0.0.0.0:8444 by default): the only door to its engines.

HTTPS with the host's own certificate (the server checks it is the host it
means to reach, by its name). Engines listen on the host's loopback only;
the ingress forwards to one of them only:

- an inference path (``/v1/chat/completions``, ``/v1/completions``,
  ``/v1/systemone``), anything else 404 ``not_found``;
- with the gate key of a launch in ``X-CapyCTL-Gate``, a key the server gave
  over the control link (``open_gate``) and has not closed: 403
  ``gate_refused`` otherwise;
- a body of at most 8 MiB sent with ``Content-Length`` (413 ``too_large``
  at once, before the body is read; 411 without a length).

One request per connection: the request goes to the engine with ``Connection:
close`` (the gate header left out), and the engine's answer comes back byte
for byte. The moment the server's connection goes away, the engine's is
closed: that is how an engine on another machine learns its client left.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl

import anyio
import msgspec

from capyctl.domain.limits import HOST_MAX_BODY

log = logging.getLogger("capyctl.ingress")
PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/systemone"})
GATE = b"x-capyctl-gate"
MAX_BODY = HOST_MAX_BODY
MAX_HEAD = 64 << 10
HEAD_TIMEOUT = 10.0  # seconds from a request's first byte to the end of its head
IDLE_TIMEOUT = 60.0  # seconds a connection opened ahead (the server's spare) may wait for its request
_READ = 64 << 10


class Ingress:
    def __init__(self, tls: ssl.SSLContext, max_body: int = MAX_BODY) -> None:
        self._tls = tls
        self._max_body = max_body
        self._gates: dict[str, int] = {}  # gate key -> the engine's port on this host's loopback

    def open_gate(self, key: str, port: int) -> None:
        if not key or not 0 < port < 65536:
            raise ValueError("a gate needs a key and an engine port")
        self._gates[key] = port

    def close_gate(self, key: str) -> None:
        self._gates.pop(key, None)

    async def serve(self, sock: socket.socket, stopping: anyio.Event) -> None:
        server = await asyncio.start_server(self._serve_one, sock=sock, ssl=self._tls, limit=MAX_HEAD,
                                            ssl_handshake_timeout=HEAD_TIMEOUT)
        async with server:
            await stopping.wait()

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # each event leaves as it comes: asyncio sets TCP_NODELAY only on sockets made with proto IPPROTO_TCP,
        # and a listening socket made with proto 0 accepts sockets of proto 0 (Nagle, then the delayed ACK,
        # held the event after the head some 40 ms)
        raw = writer.get_extra_info("socket")
        if raw is not None:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            await self._forward(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            pass  # the server went away: nothing to answer
        except Exception:  # a bug of the ingress: this request fails, the ingress goes on
            log.exception("ingress: a request failed")
        finally:
            writer.close()

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:  # the server opens a connection ahead of its next request: one with no request yet just closes
            async with asyncio.timeout(IDLE_TIMEOUT):
                first = await reader.readexactly(1)
        except (asyncio.IncompleteReadError, TimeoutError):
            return
        try:
            async with asyncio.timeout(HEAD_TIMEOUT):
                head = first + await reader.readuntil(b"\r\n\r\n")
        except (asyncio.LimitOverrunError, asyncio.IncompleteReadError, TimeoutError):
            await _answer(writer, 400, "invalid_request", "no complete request head")
            return
        lines = head[:-4].split(b"\r\n")
        parts = lines[0].split(b" ")
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
            await _answer(writer, 400, "invalid_request", "not an HTTP/1.1 request line")
            return
        method, target = parts[0], parts[1]
        headers: list[tuple[bytes, bytes]] = []
        for line in lines[1:]:
            name, sep, value = line.partition(b":")
            if not sep or not name or name != name.strip():
                await _answer(writer, 400, "invalid_request", "a header line is not `name: value`")
                return
            headers.append((name.lower(), value.strip()))
        found = dict(headers)
        if target.split(b"?")[0].decode("latin-1") not in PATHS or method != b"POST":
            await _answer(writer, 404, "not_found", "the ingress forwards only POSTs to an engine's inference paths")
            return
        port = self._gates.get(found.get(GATE, b"").decode("latin-1"))
        if port is None:
            await _answer(writer, 403, "gate_refused", "no open gate for this key: the launch it named is over")
            return
        if b"transfer-encoding" in found or b"content-length" not in found:
            await _answer(writer, 411, "invalid_request", "the ingress takes a body sent with Content-Length")
            return
        try:
            length = int(found[b"content-length"])
        except ValueError:
            length = -1
        if length < 0:
            await _answer(writer, 400, "invalid_request", "Content-Length is not a length")
            return
        if length > self._max_body:
            await _answer(writer, 413, "too_large", f"request body is larger than the limit of {self._max_body} bytes")
            return
        body = await reader.readexactly(length)
        kept = b"".join(name + b": " + value + b"\r\n" for name, value in headers
                        if name not in (GATE, b"connection", b"keep-alive"))
        try:
            engine_reader, engine_writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await _answer(writer, 502, "engine_unavailable", "the engine behind this gate does not answer")
            return
        try:
            engine_writer.write(lines[0] + b"\r\n" + kept + b"Connection: close\r\n\r\n" + body)
            await _pipe(engine_reader, writer, reader)
        finally:
            engine_writer.close()  # at once, also when the server's connection went first


async def _pipe(engine: asyncio.StreamReader, client: asyncio.StreamWriter, client_reader: asyncio.StreamReader
                ) -> None:
    """The engine's answer to the client until it ends, or until the client's connection is gone."""
    gone = asyncio.ensure_future(client_reader.read(1))  # the server sends nothing more: EOF means it left
    try:
        while True:
            read = asyncio.ensure_future(engine.read(_READ))
            done, _ = await asyncio.wait({read, gone}, return_when=asyncio.FIRST_COMPLETED)
            if read not in done:
                read.cancel()
                return
            data = read.result()
            if not data:
                return
            client.write(data)
            await client.drain()
    finally:
        gone.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await gone


async def _answer(writer: asyncio.StreamWriter, status: int, code: str, message: str) -> None:
    body = msgspec.json.encode({"error": {"message": message, "type": "invalid_request_error"
                                          if status < 500 else "server_error", "code": code}})
    writer.write(b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close"
                 b"\r\n\r\n" % (status, _REASONS.get(status, b"Error"), len(body)) + body)
    with contextlib.suppress(ConnectionError):
        await writer.drain()


_REASONS = {400: b"Bad Request", 403: b"Forbidden", 404: b"Not Found", 411: b"Length Required",
            413: b"Content Too Large", 502: b"Bad Gateway"}
