"""The engine session's side of a host's ingress, over real mutual TLS on 127.0.0.1: the host held to the very
certificate it holds now (a certificate its CA signed for its name before opens nothing, and no byte of a
request goes to it), the server's own client certificate shown, and what goes wrong said in the host's name,
never with an address."""

from __future__ import annotations

import asyncio
import hashlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from capyctl.adapters.engines._wire import WireEngineSession
from capyctl.adapters.pki import (
    CertificateAuthority,
    caller_certificate,
    client_ssl_context,
    host_key_and_csr,
    server_ssl_context,
)
from capyctl.domain.errors import HostUnreachable
from capyctl.domain.lifecycle import EngineAddress
from capyctl.domain.streams import Relayed, StreamEvent

BODY = b'{"model":"x","stream":true,"messages":[]}'
EVENTS = b'data: {"n":1}\n\ndata: [DONE]\n\n'
ANSWER = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Length: %d\r\n\r\n%b" % (len(EVENTS), EVENTS)
GATE_REFUSED = b'{"error":{"message":"no open gate for this key","type":"invalid_request_error","code":"gate_refused"}}'


def pem_fingerprint(cert_pem: bytes) -> str:
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(cert_pem.decode())).hexdigest()


class Ingress:
    """A stand-in for a host's ingress: TLS with a host certificate, only the caller's certificate let in;
    it keeps every byte it received, per connection, and answers each request with ``answer``."""

    def __init__(self, cert: bytes, key: bytes, caller: bytes, answer: bytes = ANSWER) -> None:
        self.tls = server_ssl_context(cert, key, caller, require_client=True)
        self.received: list[bytes] = []
        self.answer = answer

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.received.append(b"")
        index = len(self.received) - 1
        try:
            while data := await reader.read(65536):
                self.received[index] += data
                if data.endswith(BODY):
                    writer.write(self.answer)
                    await writer.drain()
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()


class World:
    def __init__(self, tmp: Path) -> None:
        self.ca = CertificateAuthority.load_or_create(tmp / "ca")
        self.key, csr = host_key_and_csr("gpu-a")
        self.cert = self.ca.sign_host(csr, "gpu-a")
        self.caller, caller_key = caller_certificate("capyctl-server")
        self.pins = {"gpu-a": pem_fingerprint(self.cert)}
        self.session = WireEngineSession()
        self.session.trust(
            client_ssl_context(self.ca.cert_pem, self.caller, caller_key, names_checked=True), self.pins.get
        )

    def another_certificate(self) -> tuple[bytes, bytes]:
        """What a revoked (or replaced) certificate of gpu-a is: the same CA, the same name, another key."""
        key, csr = host_key_and_csr("gpu-a")
        return self.ca.sign_host(csr, "gpu-a"), key


async def serving(ingress: Ingress) -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(ingress.serve, "127.0.0.1", 0, ssl=ingress.tls)
    return server, server.sockets[0].getsockname()[1]


async def chat(session: WireEngineSession, port: int) -> list[StreamEvent]:
    got: list[StreamEvent] = []

    def deliver(batch: list[StreamEvent]) -> Relayed:
        got.extend(batch)
        return Relayed.MORE

    with anyio.fail_after(10):
        async with session.chat_stream(
            EngineAddress(f"https://127.0.0.1:{port}", tls_name="gpu-a", gate="g" * 32), BODY
        ) as answer:
            await answer.pump(deliver, anyio.lowlevel.checkpoint)
    return got


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    yield World(tmp_path)


async def test_the_host_is_held_to_the_certificate_it_holds_now(world: World) -> None:
    ingress = Ingress(world.cert, world.key, world.caller)
    server, port = await serving(ingress)
    async with server:
        assert await chat(world.session, port)  # the current certificate: served
        assert ingress.received[0].endswith(BODY) and b"X-CapyCTL-Gate: " + b"g" * 32 in ingress.received[0]
        # the host joins again with a new certificate: the connection kept from before is not used again,
        # and the old certificate, still at the host's address, is refused before a byte is written to it
        world.pins["gpu-a"] = pem_fingerprint(world.another_certificate()[0])
        with pytest.raises(HostUnreachable) as refused:
            await chat(world.session, port)
        assert refused.value.extra["host"] == "gpu-a" and "127.0.0.1" not in refused.value.message
        assert "certificate" in refused.value.message
        assert ingress.received[0].count(b"POST ") == 1  # the kept connection was not used again
        assert all(data == b"" for data in ingress.received[1:])  # nor did a new one carry a byte
        del world.pins["gpu-a"]  # revoked: no certificate is it
        with pytest.raises(HostUnreachable):
            await chat(world.session, port)
        assert all(data == b"" for data in ingress.received[1:])


async def test_an_impostor_with_a_revoked_certificate_receives_no_byte(world: World) -> None:
    cert, key = world.another_certificate()  # signed by the same CA for the same name: the revoked one
    impostor = Ingress(cert, key, world.caller)
    server, port = await serving(impostor)
    async with server:
        with pytest.raises(HostUnreachable) as refused:
            await chat(world.session, port)
    assert refused.value.code == "device_offline" and refused.value.retry_after == 1
    assert "does not hold" in refused.value.message  # it was reached, and its certificate refused
    assert all(data == b"" for data in impostor.received)


async def test_an_ingress_that_cannot_be_reached_or_refuses_the_gate_is_said_in_the_hosts_name(world: World) -> None:
    closed = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = closed.sockets[0].getsockname()[1]
    closed.close()
    await closed.wait_closed()
    with pytest.raises(HostUnreachable) as unreachable:
        await chat(world.session, port)  # connection refused
    assert unreachable.value.extra["reason"] == "unreachable" and "127.0.0.1" not in unreachable.value.message
    assert str(port) not in unreachable.value.message
    refusing = Ingress(
        world.cert,
        world.key,
        world.caller,
        b"HTTP/1.1 403 Forbidden\r\nContent-Type: application/json"
        b"\r\nContent-Length: %d\r\n\r\n%b" % (len(GATE_REFUSED), GATE_REFUSED),
    )
    server, port = await serving(refusing)
    async with server:
        with pytest.raises(HostUnreachable) as gate:
            await chat(world.session, port)  # the agent restarted: it knows no gate of the old launch
    assert gate.value.extra["reason"] == "reconnecting" and gate.value.code == "device_offline"
    said = gate.value.of("chat")
    assert said.extra["model"] == "chat" and said.retry_after == 1
