"""The control link's two ends in one process, over real TLS on 127.0.0.1: the listener (server) with a
registry on fakes, and the host's join and agent. What the netns tests cannot reach cheaply: a join whose
CSR is refused spends nothing, a hello in another name, a message that is not the link's."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
import pytest
from websockets.asyncio.client import connect

from capyctl.adapters.control.host_agent import SERVER_NAME, HostAgent, LinkRefused, join
from capyctl.adapters.control.server_listener import ControlListener
from capyctl.adapters.pki import (
    CertificateAuthority,
    caller_certificate,
    client_ssl_context,
    host_key_and_csr,
    server_ssl_context,
)
from capyctl.domain.errors import CapyError
from capyctl.domain.hosts import HostState, LinkTimings
from capyctl.domain.joining import JoinFile, secret_text
from capyctl.domain.link import Goodbye, Hello, Inventory, JoinRequest, decode, encode
from capyctl.services.events import Events
from capyctl.services.server_hosts import HostRegistry
from tests.fakes.ports import FakeClock, FakeStore

CALLER = caller_certificate(SERVER_NAME)[0]


class Server:
    def __init__(self, tmp: Path) -> None:
        self.authority = CertificateAuthority.load_or_create(tmp / "ca")
        cert, key = self.authority.server_certificate([SERVER_NAME])
        self.tls = server_ssl_context(cert, key, self.authority.cert_pem, require_client=False)
        self.store, self.clock = FakeStore(), FakeClock()
        self.registry = HostRegistry(self.store, self.clock, Events(self.store, self.clock), LinkTimings())
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"

    def join_file(self, name: str, secret: bytes = bytes(range(32))) -> JoinFile:
        invite = self.registry.invite(name, secret, ttl=600)
        return JoinFile(
            host=name,
            server=self.address,
            ca_pem=self.authority.cert_pem.decode(),
            secret=secret_text(secret),
            expires_at=invite.expires_at,
        )


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    made = Server(tmp_path)
    stopping = anyio.Event()
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(ControlListener(made.registry, made.authority, made.tls, CALLER).serve, made.sock, stopping)
        yield made
        stopping.set()


async def _until(condition: Callable[[], object], what: str) -> None:
    """Polls ``condition`` (bounded: 10 s), failing with ``what`` when it never holds."""
    with anyio.move_on_after(10):
        while not condition():
            await anyio.sleep(0.01)
        return
    raise AssertionError(f"{what}: not within 10 s")


async def test_a_join_with_a_refused_csr_spends_nothing(server: Server, tmp_path: Path) -> None:
    file = server.join_file("gpu-a")
    _, csr = host_key_and_csr("gpu-other")  # a CSR in another name
    tls = client_ssl_context(server.authority.cert_pem, server_name=SERVER_NAME)
    async with connect(f"wss://{server.address}", ssl=tls, server_hostname=SERVER_NAME, proxy=None) as conn:
        await conn.send(encode(JoinRequest(host="gpu-a", secret=file.secret, csr_pem=csr.decode())))
        answer = decode(await conn.recv(decode=False))
    assert isinstance(answer, Goodbye) and answer.code == "invalid_request"
    identity = await join(file, tmp_path / "a")  # the invitation still works
    assert identity.name == "gpu-a"
    with pytest.raises(CapyError) as again:
        await join(file, tmp_path / "b")
    assert again.value.code == "join_refused" and "used" in again.value.message


async def test_the_agent_links_and_a_revocation_stops_it_for_good(server: Server, tmp_path: Path) -> None:
    await join(server.join_file("gpu-a"), tmp_path / "a")
    agent = HostAgent(tmp_path / "a", lambda: Inventory())
    stopping = anyio.Event()
    outcome: list[BaseException] = []

    async def run() -> None:
        try:
            await agent.run(stopping)
        except LinkRefused as exc:
            outcome.append(exc)

    async with anyio.create_task_group() as tasks:
        tasks.start_soon(run)
        await _until(lambda: server.registry.view("gpu-a")["connected"], "the link")
        assert server.registry.state("gpu-a") == HostState.ONLINE
        await server.registry.revoke("gpu-a")
        await _until(lambda: outcome, "the agent's end")
    assert "revoked" in str(outcome[0])
    with pytest.raises(LinkRefused):  # started again: refused at once, not dialling for ever
        with anyio.fail_after(10):
            await HostAgent(tmp_path / "a", lambda: Inventory()).run(anyio.Event())


async def test_a_hello_in_another_name_or_a_stray_message_is_refused(server: Server, tmp_path: Path) -> None:
    await join(server.join_file("gpu-a"), tmp_path / "a")
    state = tmp_path / "a" / "identity"
    tls = client_ssl_context(
        server.authority.cert_pem,
        (state / "host-cert.pem").read_bytes(),
        (state / "host-key.pem").read_bytes(),
        server_name=SERVER_NAME,
    )
    for first in (Hello(host="gpu-b", version="0", protocol=1), Inventory()):
        async with connect(f"wss://{server.address}", ssl=tls, server_hostname=SERVER_NAME, proxy=None) as conn:
            await conn.send(encode(first))
            answer = decode(await conn.recv(decode=False))
        assert isinstance(answer, Goodbye) and answer.code == "invalid_request" and "hello" in answer.message
    assert server.registry.view("gpu-a")["connected"] is False
    async with connect(f"wss://{server.address}", ssl=tls, server_hostname=SERVER_NAME, proxy=None) as conn:
        await conn.send(encode(Hello(host="gpu-a", version="0", protocol=1)))
        await _until(lambda: server.registry.view("gpu-a")["connected"], "the link")
        await conn.send(b"not a message")
        answer = decode(await conn.recv(decode=False))
        while not isinstance(answer, Goodbye):  # heartbeats came first
            answer = decode(await conn.recv(decode=False))
    assert answer.code == "invalid_request"
    await _until(lambda: not server.registry.view("gpu-a")["connected"], "the link's end")
