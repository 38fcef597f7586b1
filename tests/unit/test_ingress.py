"""A host's ingress over real TLS on 127.0.0.1, in front of a stand-in engine on loopback: what it forwards,
what it refuses (before reading a body too large), and the engine's connection closed when the client goes."""

from __future__ import annotations

import asyncio
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import msgspec
import pytest

from capyctl.adapters.control.ingress import Ingress
from capyctl.adapters.pki import CertificateAuthority, client_ssl_context, host_key_and_csr, server_ssl_context


class Engine:
    """Reads one request, keeps it, then streams an answer until told to end; notes when its client left."""

    def __init__(self, pieces: int) -> None:
        self.requests: list[bytes] = []
        self.pieces = pieces
        self.closed = asyncio.Event()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int([line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")][0]
                     .split(b":")[1])
        self.requests.append(head + await reader.readexactly(length))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
        try:
            for i in range(self.pieces):
                writer.write(b"data: {\"n\": %d}\n\n" % i)
                await writer.drain()
                await asyncio.sleep(0.01)
            writer.close()
            await reader.read()  # waits for the other side to close
        except ConnectionError:
            pass
        finally:
            self.closed.set()


class Setup:
    def __init__(self, tmp: Path) -> None:
        self.ca = CertificateAuthority.load_or_create(tmp / "ca")
        key, csr = host_key_and_csr("gpu-a")
        cert = self.ca.sign_host(csr, "gpu-a")
        self.ingress = Ingress(server_ssl_context(cert, key, self.ca.cert_pem, require_client=False))
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]

    async def ask(self, request: bytes, name: str = "gpu-a", read: int | None = None) -> bytes:
        tls = client_ssl_context(self.ca.cert_pem, server_name=name)
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port, ssl=tls, server_hostname=name)
        writer.write(request)
        try:
            with anyio.fail_after(10):
                return await (reader.read(read) if read is not None else reader.read())
        finally:
            writer.close()


def post(body: bytes, gate: str | None = "k1", path: str = "/v1/chat/completions", length: int | None = None) -> bytes:
    gate_line = f"X-CapyCTL-Gate: {gate}\r\n".encode() if gate is not None else b""
    return (f"POST {path} HTTP/1.1\r\nHost: gpu-a\r\nContent-Type: application/json\r\n".encode() + gate_line
            + b"Content-Length: %d\r\nConnection: keep-alive\r\n\r\n" % (len(body) if length is None else length) + body)


def error_of(answer: bytes) -> tuple[int, str]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), msgspec.json.decode(body)["error"]["code"]


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[Setup]:
    made = Setup(tmp_path)
    stopping = anyio.Event()
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(made.ingress.serve, made.sock, stopping)
        yield made
        stopping.set()


async def engine(pieces: int) -> tuple[Engine, asyncio.Server, int]:
    stand_in = Engine(pieces)
    server = await asyncio.start_server(stand_in.serve, "127.0.0.1", 0)
    return stand_in, server, server.sockets[0].getsockname()[1]


async def test_a_request_with_an_open_gate_reaches_the_engine_and_its_answer_comes_back_whole(setup: Setup) -> None:
    stand_in, server, port = await engine(pieces=3)
    setup.ingress.open_gate("k1", port)
    body = b'{"model": "m", "messages": []}'
    answer = await setup.ask(post(body))
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
    assert answer.endswith(b'data: {"n": 0}\n\ndata: {"n": 1}\n\ndata: {"n": 2}\n\n')
    (seen,) = stand_in.requests
    assert seen.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n") and seen.endswith(b"\r\n\r\n" + body)
    assert b"x-capyctl-gate" not in seen.lower()  # the key stays at the ingress
    server.close()


class KeptAlive:
    """An engine that answers each request on a connection with a length, keeping the connection open."""

    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[bytes] = []

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                self.requests.append(await reader.readexactly(length))
                answer = b"answer %d" % len(self.requests)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(answer), answer))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass


async def test_one_connection_carries_request_after_request_and_the_engines_is_kept_too(setup: Setup) -> None:
    stand_in = KeptAlive()
    server = await asyncio.start_server(stand_in.serve, "127.0.0.1", 0)
    setup.ingress.open_gate("k1", server.sockets[0].getsockname()[1])
    tls = client_ssl_context(setup.ca.cert_pem, server_name="gpu-a")
    reader, writer = await asyncio.open_connection("127.0.0.1", setup.port, ssl=tls, server_hostname="gpu-a")
    try:
        with anyio.fail_after(10):
            for n in (1, 2, 3):
                writer.write(post(b'{"n": %d}' % n))
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200 OK") and await reader.readexactly(8) == b"answer %d" % n
    finally:
        writer.close()
    assert stand_in.requests == [b'{"n": 1}', b'{"n": 2}', b'{"n": 3}']
    assert stand_in.connections == 1  # no connect, and no handshake, per request on either side
    setup.ingress.close_gate("k1")  # the launch ended: its kept connections go with it
    server.close()


async def test_refusals_say_why_and_reach_no_engine(setup: Setup) -> None:
    stand_in, server, port = await engine(pieces=1)
    setup.ingress.open_gate("k1", port)
    assert error_of(await setup.ask(post(b"{}", gate=None))) == (403, "gate_refused")
    assert error_of(await setup.ask(post(b"{}", gate="other"))) == (403, "gate_refused")
    assert error_of(await setup.ask(post(b"{}", path="/metrics"))) == (404, "not_found")
    assert error_of(await setup.ask(b"GET /v1/chat/completions HTTP/1.1\r\nX-CapyCTL-Gate: k1\r\n\r\n")) == (
        404, "not_found")
    # a body declared past 8 MiB is refused at once: the answer comes though no byte of it was sent
    assert error_of(await setup.ask(post(b"", length=(8 << 20) + 1))) == (413, "too_large")
    chunked = (b"POST /v1/chat/completions HTTP/1.1\r\nX-CapyCTL-Gate: k1\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"2\r\n{}\r\n0\r\n\r\n")
    assert error_of(await setup.ask(chunked)) == (411, "invalid_request")
    setup.ingress.close_gate("k1")  # the launch ended: its key is stale
    assert error_of(await setup.ask(post(b"{}"))) == (403, "gate_refused")
    assert stand_in.requests == []
    server.close()


async def test_the_engine_connection_closes_when_the_client_hangs_up(setup: Setup) -> None:
    stand_in, server, port = await engine(pieces=100_000)  # streams for minutes unless cut
    setup.ingress.open_gate("k1", port)
    first = await setup.ask(post(b"{}"), read=200)  # reads the start, then hangs up
    assert first.startswith(b"HTTP/1.1 200 OK")
    with anyio.fail_after(5):
        await stand_in.closed.wait()
    server.close()


async def test_the_ingress_is_known_by_its_hosts_name_only(setup: Setup) -> None:
    with pytest.raises(ssl.SSLCertVerificationError, match="gpu-b"):
        await setup.ask(post(b"{}"), name="gpu-b")
