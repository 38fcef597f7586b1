"""A host's ingress over real mutual TLS on 127.0.0.1, in front of stand-in engines on loopback: who may
connect, what it forwards (rebuilt from the parsed request), what it refuses and when (before reading a body
too large, a request malformed or too slow), pipelined requests answered in order, the engine's connection
closed when the client goes, and a stop that leaves nothing behind."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import msgspec
import pytest

from capyctl.adapters.control import host_ingress as ingress_module
from capyctl.adapters.control.host_ingress import BODY_TIMEOUT, HEADER_TIMEOUT, Ingress
from capyctl.adapters.pki import CertificateAuthority, caller_certificate, client_ssl_context, host_key_and_csr

Stream = tuple[asyncio.StreamReader, asyncio.StreamWriter]


class Engine:
    """Reads one request, keeps it, then streams an answer; counts its connections, notes when its client left."""

    def __init__(self, pieces: int) -> None:
        self.connections = 0
        self.requests: list[bytes] = []
        self.pieces = pieces
        self.closed = asyncio.Event()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(
            next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")).split(b":")[1]
        )
        self.requests.append(head + await reader.readexactly(length))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
        try:
            for i in range(self.pieces):
                writer.write(b'data: {"n": %d}\n\n' % i)
                await writer.drain()
                await asyncio.sleep(0.01)
            writer.close()
            await reader.read()  # waits for the other side to close
        except ConnectionError:
            pass
        finally:
            self.closed.set()


class KeptAlive:
    """Answers each request on a connection with a length, keeping the connection open; the second half of
    each answer waits for ``go`` (set from the start)."""

    def __init__(self) -> None:
        self.connections = 0
        self.requests: list[bytes] = []
        self.go = asyncio.Event()
        self.go.set()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                self.requests.append(await reader.readexactly(length))
                answer = b"answer %d" % len(self.requests)
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%b" % (len(answer), answer[:4]))
                await writer.drain()
                await self.go.wait()
                writer.write(answer[4:])
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass


class Setup:
    def __init__(
        self,
        tmp: Path,
        trusted: bool = True,
        header_timeout: float = HEADER_TIMEOUT,
        body_timeout: float = BODY_TIMEOUT,
    ) -> None:
        self.ca = CertificateAuthority.load_or_create(tmp / "ca")
        key, csr = host_key_and_csr("gpu-a")
        self.ingress = Ingress(
            self.ca.sign_host(csr, "gpu-a"), key, header_timeout=header_timeout, body_timeout=body_timeout
        )
        self.caller_cert, self.caller_key = caller_certificate("capyctl-server")
        if trusted:
            self.ingress.trust_callers(self.caller_cert)
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]

    def tls(self, name: str = "gpu-a") -> ssl.SSLContext:
        """The server's side: it shows the caller certificate the ingress was told to trust."""
        return client_ssl_context(self.ca.cert_pem, self.caller_cert, self.caller_key, server_name=name)

    async def connect(self, tls: ssl.SSLContext | None = None, name: str = "gpu-a") -> Stream:
        with anyio.fail_after(10):
            return await asyncio.open_connection(
                "127.0.0.1", self.port, ssl=tls or self.tls(name), server_hostname=name
            )

    async def ask(self, request: bytes, name: str = "gpu-a", read: int | None = None) -> bytes:
        reader, writer = await self.connect(name=name)
        writer.write(request)
        try:
            with anyio.fail_after(10):
                return await (reader.read(read) if read is not None else reader.read())
        finally:
            writer.close()


def post(body: bytes, gate: str | None = "k1", path: str = "/v1/chat/completions", length: int | None = None) -> bytes:
    gate_line = f"X-CapyCTL-Gate: {gate}\r\n".encode() if gate is not None else b""
    return (
        f"POST {path} HTTP/1.1\r\nHost: gpu-a\r\nContent-Type: application/json\r\n".encode()
        + gate_line
        + b"Content-Length: %d\r\nConnection: keep-alive\r\n\r\n" % (len(body) if length is None else length)
        + body
    )


def error_of(answer: bytes) -> tuple[int, str]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), msgspec.json.decode(body)["error"]["code"]


@contextlib.asynccontextmanager
async def serving(made: Setup) -> AsyncIterator[Setup]:
    stopping = anyio.Event()
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(made.ingress.serve, made.sock, stopping)
        yield made
        stopping.set()


@pytest.fixture
async def setup(tmp_path: Path) -> AsyncIterator[Setup]:
    async with serving(Setup(tmp_path)) as made:
        yield made


async def engine(pieces: int) -> tuple[Engine, asyncio.Server, int]:
    stand_in = Engine(pieces)
    server = await asyncio.start_server(stand_in.serve, "127.0.0.1", 0)
    return stand_in, server, server.sockets[0].getsockname()[1]


async def kept_alive() -> tuple[KeptAlive, asyncio.Server, int]:
    stand_in = KeptAlive()
    server = await asyncio.start_server(stand_in.serve, "127.0.0.1", 0)
    return stand_in, server, server.sockets[0].getsockname()[1]


@contextlib.asynccontextmanager
async def gated(setup: Setup) -> AsyncIterator[tuple[KeptAlive, asyncio.StreamReader, asyncio.StreamWriter]]:
    """A kept-alive stand-in behind the open gate ``k1``, and one connection to the ingress; both closed after."""
    stand_in, server, port = await kept_alive()
    setup.ingress.open_gate("k1", port)
    reader, writer = await setup.connect()
    try:
        yield stand_in, reader, writer
    finally:
        writer.close()
        server.close()


async def answer_of(reader: asyncio.StreamReader) -> bytes:
    """One answer with a length, head and body."""
    with anyio.fail_after(10):
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        return head + await reader.readexactly(length)


async def rest(reader: asyncio.StreamReader) -> bytes:
    """What comes until the connection ends (by a close, a reset, or TLS cut short)."""
    got = b""
    with anyio.fail_after(10):
        try:
            while data := await reader.read(1 << 16):
                got += data
        except OSError:
            pass
    return got


async def test_a_request_with_an_open_gate_reaches_the_engine_and_its_answer_comes_back_whole(setup: Setup) -> None:
    stand_in, server, port = await engine(pieces=3)
    setup.ingress.open_gate("k1", port)
    body = b'{"model": "m", "messages": []}'
    answer = await setup.ask(post(body).replace(b"application/json", b"application/json \t"))
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n")
    assert answer.endswith(b'data: {"n": 0}\n\ndata: {"n": 1}\n\ndata: {"n": 2}\n\n')
    # rebuilt from the parsed request: the same lines less the gate (the key stays at the ingress), without
    # the blanks that ended a value
    assert stand_in.requests == [post(body).replace(b"X-CapyCTL-Gate: k1\r\n", b"")]
    server.close()


async def test_one_connection_carries_request_after_request_and_the_engines_is_kept_too(setup: Setup) -> None:
    async with gated(setup) as (stand_in, reader, writer):
        for n in (1, 2, 3):
            writer.write(post(b'{"n": %d}' % n))
            answer = await answer_of(reader)
            assert answer.startswith(b"HTTP/1.1 200 OK") and answer.endswith(b"\r\n\r\nanswer %d" % n)
    assert stand_in.requests == [b'{"n": 1}', b'{"n": 2}', b'{"n": 3}']
    assert stand_in.connections == 1  # no connect, and no handshake, per request on either side
    setup.ingress.close_gate("k1")  # the launch ended: its kept connections go with it


@pytest.mark.parametrize("mid_answer", [False, True], ids=["written-at-once", "sent-mid-answer"])
async def test_a_pipelined_request_is_answered_after_the_one_before_it(setup: Setup, mid_answer: bool) -> None:
    async with gated(setup) as (stand_in, reader, writer):
        if mid_answer:
            stand_in.go.clear()  # the first answer stops halfway until the second request is in
            writer.write(post(b'{"n": 1}'))
            with anyio.fail_after(10):
                assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 OK")
                assert await reader.readexactly(4) == b"answ"
            writer.write(post(b'{"n": 2}'))
            stand_in.go.set()
            assert await reader.readexactly(4) == b"er 1"
        else:
            writer.write(post(b'{"n": 1}') + post(b'{"n": 2}'))
            assert (await answer_of(reader)).endswith(b"\r\n\r\nanswer 1")
        assert (await answer_of(reader)).endswith(b"\r\n\r\nanswer 2")
    assert stand_in.requests == [b'{"n": 1}', b'{"n": 2}']
    assert stand_in.connections == 1


async def test_a_malformed_request_behind_a_good_one_is_refused_after_the_good_ones_answer(setup: Setup) -> None:
    async with gated(setup) as (stand_in, reader, writer):
        writer.write(post(b'{"n": 1}') + post(b'{"n": 2}').replace(b"Host: gpu-a\r\n", b"Host: gpu-a\n"))
        assert (await answer_of(reader)).endswith(b"\r\n\r\nanswer 1")
        assert error_of(await answer_of(reader)) == (400, "invalid_request")
        assert await rest(reader) == b""
    assert stand_in.requests == [b'{"n": 1}']


async def test_refusals_say_why_and_reach_no_engine(setup: Setup) -> None:
    stand_in, server, port = await engine(pieces=1)
    setup.ingress.open_gate("k1", port)
    assert error_of(await setup.ask(post(b"{}", gate=None))) == (403, "gate_refused")
    assert error_of(await setup.ask(post(b"{}", gate="other"))) == (403, "gate_refused")
    assert error_of(await setup.ask(post(b"{}", path="/metrics"))) == (404, "not_found")
    assert error_of(await setup.ask(b"GET /v1/chat/completions HTTP/1.1\r\nX-CapyCTL-Gate: k1\r\n\r\n")) == (
        404,
        "not_found",
    )
    # a body declared past 8 MiB is refused at once: the answer comes though no byte of it was sent
    assert error_of(await setup.ask(post(b"", length=(8 << 20) + 1))) == (413, "too_large")
    chunked = (
        b"POST /v1/chat/completions HTTP/1.1\r\nX-CapyCTL-Gate: k1\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\n{}\r\n0\r\n\r\n"
    )
    assert error_of(await setup.ask(chunked)) == (411, "invalid_request")
    no_length = b"POST /v1/chat/completions HTTP/1.1\r\nX-CapyCTL-Gate: k1\r\n\r\n"
    assert error_of(await setup.ask(no_length)) == (411, "invalid_request")
    setup.ingress.close_gate("k1")  # the launch ended: its key is stale
    assert error_of(await setup.ask(post(b"{}"))) == (403, "gate_refused")
    assert stand_in.connections == 0
    server.close()


GOOD = post(b"{}")
MALFORMED = {
    "bare LF ending a header line": GOOD.replace(b"Host: gpu-a\r\n", b"Host: gpu-a\n"),
    "bare LF ending every line": GOOD.replace(b"\r\n", b"\n"),
    "a length with a sign": GOOD.replace(b"Content-Length: 2", b"Content-Length: +2"),
    "a length given twice": GOOD.replace(b"Content-Length: 2\r\n", b"Content-Length: 2\r\nContent-Length: 2\r\n"),
    "two lengths in one value": GOOD.replace(b"Content-Length: 2", b"Content-Length: 2, 2"),
    "a folded header line": GOOD.replace(b"Host: gpu-a\r\n", b"Host: gpu-a\r\n  also\r\n"),
    "a blank before the colon": GOOD.replace(b"Host: gpu-a", b"Host : gpu-a"),
    "a control character in a value": GOOD.replace(b"Host: gpu-a", b"Host: gpu\x01a"),
    "a length beside Transfer-Encoding": GOOD.replace(
        b"Content-Length: 2\r\n", b"Content-Length: 2\r\nTransfer-Encoding: chunked\r\n"
    ),
    "an upgrade": GOOD.replace(b"Connection: keep-alive", b"Connection: upgrade\r\nUpgrade: websocket"),
    "not HTTP/1": GOOD.replace(b"HTTP/1.1", b"HTTP/2.0"),
    "a head over 64 KiB": GOOD.replace(b"Host: gpu-a", b"Host: gpu-a\r\nX-Pad: " + b"a" * (96 << 10)),
}


@pytest.mark.parametrize("request_bytes", MALFORMED.values(), ids=MALFORMED.keys())
async def test_a_malformed_request_is_refused_400_and_reaches_no_engine(setup: Setup, request_bytes: bytes) -> None:
    stand_in, server, port = await engine(pieces=1)
    setup.ingress.open_gate("k1", port)
    assert error_of(await setup.ask(request_bytes)) == (400, "invalid_request")
    assert stand_in.connections == 0
    server.close()


async def test_a_body_shorter_than_its_length_times_out_408_and_reaches_no_engine(tmp_path: Path) -> None:
    async with serving(Setup(tmp_path, body_timeout=0.3)) as made:
        stand_in, server, port = await engine(pieces=1)
        made.ingress.open_gate("k1", port)
        with anyio.fail_after(5):  # the body's time, not the head's 10 s or the idle 60 s
            answer = await made.ask(post(b"x" * 10, length=100))
        assert error_of(answer) == (408, "request_timeout")
        assert stand_in.connections == 0
        server.close()


async def test_a_head_not_whole_in_time_is_refused_408(tmp_path: Path) -> None:
    async with serving(Setup(tmp_path, header_timeout=0.3)) as made:
        stand_in, server, port = await engine(pieces=1)
        made.ingress.open_gate("k1", port)
        with anyio.fail_after(5):
            answer = await made.ask(post(b"{}").partition(b"Content-Length")[0])
        assert error_of(answer) == (408, "request_timeout")
        assert stand_in.connections == 0
        server.close()


@pytest.mark.parametrize("behind", [False, True], ids=["alone", "with-a-request-pipelined-behind"])
async def test_the_engine_connection_closes_when_the_client_hangs_up(setup: Setup, behind: bool) -> None:
    stand_in, server, port = await engine(pieces=100_000)  # streams for minutes unless cut
    setup.ingress.open_gate("k1", port)
    first = await setup.ask(post(b"{}") * (2 if behind else 1), read=200)  # reads the start, then hangs up
    assert first.startswith(b"HTTP/1.1 200 OK")
    with anyio.fail_after(5):
        await stand_in.closed.wait()
    server.close()


async def test_the_ingress_is_known_by_its_hosts_name_only(setup: Setup) -> None:
    with pytest.raises(ssl.SSLCertVerificationError, match="gpu-b"):
        await setup.ask(post(b"{}"), name="gpu-b")


def tls12(context: ssl.SSLContext) -> ssl.SSLContext:
    """TLS 1.2, where the server's refusal of the client's certificate ends the handshake itself."""
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    return context


@pytest.mark.parametrize("shown", ["none", "a host's"])
async def test_only_the_trusted_caller_completes_a_handshake(setup: Setup, shown: str) -> None:
    stand_in, server, port = await engine(pieces=1)
    setup.ingress.open_gate("k1", port)
    other_key, csr = host_key_and_csr("gpu-b")  # a host of the same CA: every host's certificate is so signed
    cert, key = (setup.ca.sign_host(csr, "gpu-b"), other_key) if shown == "a host's" else (None, None)
    with pytest.raises((ssl.SSLError, ConnectionError)):  # the server's alert, or its closing mid-handshake
        await setup.connect(tls12(client_ssl_context(setup.ca.cert_pem, cert, key, server_name="gpu-a")))
    # in TLS 1.3 the client's side ends its handshake before the server has checked its certificate: the
    # server's refusal shows in the first read, and no HTTP answer comes
    reader, writer = await setup.connect(client_ssl_context(setup.ca.cert_pem, cert, key, server_name="gpu-a"))
    writer.write(post(b"{}"))
    assert await rest(reader) == b""
    writer.close()
    assert stand_in.connections == 0
    server.close()


async def test_before_trust_callers_no_connection_gets_a_byte(tmp_path: Path) -> None:
    async with serving(Setup(tmp_path, trusted=False)) as made:
        reader, writer = await asyncio.open_connection("127.0.0.1", made.port)  # plain TCP: the raw bytes
        writer.write(b"\x16\x03\x01\x00\x05hello")
        assert await rest(reader) == b""
        writer.close()
        with pytest.raises((ssl.SSLError, ConnectionError)):  # the trusted caller's own certificate too
            await made.connect()


@pytest.mark.parametrize("how", ["stopping", "cancelled"])
async def test_the_ingress_stops_with_connections_open_and_leaves_nothing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, how: str
) -> None:
    caplog.set_level(logging.WARNING)
    made = Setup(tmp_path)
    streaming, streaming_server, port = await engine(pieces=100_000)
    made.ingress.open_gate("k1", port)
    _, kept_server, port = await kept_alive()
    made.ingress.open_gate("k2", port)
    stopping = anyio.Event()
    serve = asyncio.create_task(made.ingress.serve(made.sock, stopping))
    idle = await made.connect()  # answered once, now waiting for its next request
    idle[1].write(post(b"{}", gate="k2"))
    await answer_of(idle[0])
    mid_head = await made.connect()  # the same, then half a head
    mid_head[1].write(post(b"{}", gate="k2"))
    await answer_of(mid_head[0])
    mid_head[1].write(post(b"{}", gate="k2")[:40])
    mid_answer = await made.connect()  # an answer streaming
    mid_answer[1].write(post(b"{}"))
    with anyio.fail_after(10):
        assert (await mid_answer[0].readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 OK")
    if how == "stopping":
        stopping.set()
    else:
        serve.cancel()
    with anyio.fail_after(10):
        await asyncio.wait({serve})
    assert serve.cancelled() if how == "cancelled" else serve.result() is None
    for reader, writer in (idle, mid_head, mid_answer):
        await rest(reader)  # ends: the connection was closed
        writer.close()
    with anyio.fail_after(5):
        await streaming.closed.wait()  # the engine's connection of the answer cut short is closed too
    left = [
        task
        for task in asyncio.all_tasks()
        if not task.done()
        and getattr(task.get_coro(), "cr_code", None) is not None
        and task.get_coro().cr_code.co_filename == ingress_module.__file__
    ]  # type: ignore[union-attr]
    assert left == []
    gc.collect()  # a task dropped while pending is reported as it is collected
    assert [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR] == []
    streaming_server.close()
    kept_server.close()
