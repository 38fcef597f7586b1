"""A host running an engine on the server's commands, in one process over real TLS and real sockets: the
server's registry and control listener, the host's agent, ingress and engines (a stand-in vLLM as a real
child process). Launch, readiness, a chat through the ingress's gate (only with the server's caller
certificate), fencing of an older launch, stop (gate closed, process gone), an engine's exit told to the
server, and the agent's stop: goodbye first, then each engine's end told with its cause."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import ssl
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from capyctl.adapters.control.host_agent import SERVER_NAME, HostAgent, join
from capyctl.adapters.control.server_listener import ControlListener
from capyctl.adapters.pki import CertificateAuthority, caller_certificate, client_ssl_context, server_ssl_context
from capyctl.domain.hosts import HostState, LinkTimings
from capyctl.domain.joining import JoinFile, secret_text
from capyctl.domain.limits import Limits
from capyctl.domain.link import Inventory
from capyctl.entrypoints.container import build_host_container
from capyctl.services.events import Events
from capyctl.services.fleet import decode_spec
from capyctl.services.server_hosts import HostRegistry
from tests.fakes.ports import FakeClock, FakeStore
from tests.fakes.standin_venv import make_standin_venv
from tests.integration.harness import pid_alive

pytestmark = pytest.mark.integration


async def until(condition: Callable[[], Any], what: str, timeout: float = 30) -> Any:
    with anyio.move_on_after(timeout):
        while not (value := await condition()):
            await anyio.sleep(0.05)
        return value
    raise AssertionError(f"{what}: not within {timeout} s")


CALLER = caller_certificate(SERVER_NAME)


async def chat(ca: bytes, port: int, gate: str, caller: tuple[bytes, bytes] | None = CALLER) -> bytes:
    body = msgspec.json.encode({"model": "chat", "messages": [{"role": "user", "content": "hi"}]})
    tls = client_ssl_context(ca, *(caller or (None, None)), server_name="gpu-a")
    with anyio.fail_after(30):
        stream = await anyio.connect_tcp("127.0.0.1", port, ssl_context=tls, tls_hostname="gpu-a")
        try:
            await stream.send(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: gpu-a\r\nContent-Type: application/json\r\n"
                b"X-CapyCTL-Gate: "
                + gate.encode()
                + b"\r\nConnection: close\r\nContent-Length: %d\r\n\r\n" % len(body)
                + body
            )
            answer = b""
            try:
                while True:
                    answer += await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError, ssl.SSLError):
                return answer
        finally:
            with contextlib.suppress(ssl.SSLError, OSError, anyio.BrokenResourceError):
                await stream.aclose()  # a refused handshake cannot be shut down cleanly


async def test_a_host_runs_an_engine_on_the_servers_commands(tmp_path: Path) -> None:
    authority = CertificateAuthority.load_or_create(tmp_path / "ca")
    cert, key = authority.server_certificate([SERVER_NAME])
    store, clock = FakeStore(), FakeClock()
    registry = HostRegistry(store, clock, Events(store, clock), LinkTimings())
    control = socket.create_server(("127.0.0.1", 0))
    secret = bytes(range(32))
    invite = registry.invite("gpu-a", secret, ttl=600)
    join_file = JoinFile(
        host="gpu-a",
        server=f"127.0.0.1:{control.getsockname()[1]}",
        ca_pem=authority.cert_pem.decode(),
        secret=secret_text(secret),
        expires_at=invite.expires_at,
    )
    stopping = anyio.Event()
    async with anyio.create_task_group() as tasks:
        tasks.start_soon(
            ControlListener(
                registry, authority, server_ssl_context(cert, key, authority.cert_pem, require_client=False), CALLER[0]
            ).serve,
            control,
            stopping,
        )
        state = tmp_path / "host"
        await join(join_file, state)
        host_cert, host_key = (
            (state / "identity" / "host-cert.pem").read_bytes(),
            (state / "identity" / "host-key.pem").read_bytes(),
        )
        limits = Limits()
        host = build_host_container(state, limits.header_timeout, limits.body_timeout)  # what start host runs
        ingress = host.ingress()
        ingress_sock = socket.create_server(("127.0.0.1", 0))
        engines = host.engines()
        agent_stopping = anyio.Event()  # the agent's own stop, apart from the test's end

        async def leaving() -> None:
            await engines.stop_all(agent.tell)

        agent = HostAgent(
            state,
            lambda: Inventory(),
            host.commands(),
            running=engines.running,
            ingress_port=ingress_sock.getsockname()[1],
            callers=ingress.trust_callers,
            leaving=leaving,
        )
        tasks.start_soon(ingress.serve, ingress_sock, stopping)
        tasks.start_soon(agent.run, agent_stopping)
        tasks.start_soon(engines.watch, agent.tell)
        tasks.start_soon(engines.report_loads, agent.tell)

        async def linked() -> bool:
            return registry.view("gpu-a")["connected"]

        await until(linked, "the host's link")
        venv = make_standin_venv(tmp_path / "vllm-venv", "vllm", "0.32.0")
        engine = await registry.add_engine("gpu-a", str(venv), "vllm", None)
        model = tmp_path / "model"
        model.mkdir()
        spec = decode_spec({"name": "chat", "engine": "vllm", "model": str(model)})
        args = {"spec": msgspec.to_builtins(spec), "engine": msgspec.to_builtins(engine), "gate": "g" * 32}
        launched = await registry.command("gpu-a", "launch", args, instance="chat", generation=1)
        assert launched.ok, launched
        pid = launched.detail["pid"]
        assert pid_alive(pid)

        async def ready() -> bool:
            probe = await registry.command("gpu-a", "probe", {}, instance="chat", generation=1)
            assert probe.ok, probe
            return probe.detail["ready"]

        await until(ready, "the engine ready")
        answer = await chat(authority.cert_pem, ingress_sock.getsockname()[1], "g" * 32)
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
        assert b'"chat.completion"' in answer
        # the gate key alone opens nothing: a caller without the server's certificate gets no answer at all
        for caller in (None, (host_cert, host_key)):
            assert await chat(authority.cert_pem, ingress_sock.getsockname()[1], "g" * 32, caller) == b""

        # its load, read from the engine's own metrics on the host, reaches the server in the host's report
        async def load() -> Any:
            return registry.load_of("gpu-a", "chat")

        reported = await until(load, "the engine's load reported")
        assert (reported[0].running, reported[0].waiting) == (0, 0)  # idle now: its chat has been answered

        stale = await registry.command("gpu-a", "stop", {}, instance="chat", generation=0)
        assert not stale.ok and stale.code == "stale_generation"
        assert pid_alive(pid)
        stopped = await registry.command("gpu-a", "stop", {"grace": 5}, instance="chat", generation=1)
        assert stopped.ok and not pid_alive(pid)
        refused = await chat(authority.cert_pem, ingress_sock.getsockname()[1], "g" * 32)
        assert b" 403 " in refused.split(b"\r\n")[0] and b"gate_refused" in refused

        again = await registry.command("gpu-a", "launch", {**args, "gate": "h" * 32}, instance="chat", generation=2)
        assert again.ok, again
        os.kill(again.detail["pid"], signal.SIGKILL)  # the engine dies on its own

        async def told() -> list[dict[str, Any]]:
            return registry.view("gpu-a")["exits"]

        (exit_,) = await until(told, "the engine's exit told to the server")
        assert (exit_["instance"], exit_["pid"], exit_["returncode"], exit_["cause"]) == (
            "chat",
            again.detail["pid"],
            -9,
            "exited",
        )
        assert engines.running() == []  # an engine that exited is no longer reported as running

        third = await registry.command("gpu-a", "launch", {**args, "gate": "i" * 32}, instance="chat", generation=3)
        assert third.ok, third
        agent_stopping.set()  # the agent is asked to stop (its SIGTERM): goodbye, then its engines end, told

        async def ended() -> list[dict[str, Any]]:
            return [e for e in registry.view("gpu-a")["exits"] if e["pid"] == third.detail["pid"]]

        (last,) = await until(ended, "the stopped agent's engine end told to the server")
        assert last["cause"] == "agent_stopped" and not pid_alive(third.detail["pid"])
        assert registry.state("gpu-a") == HostState.DISCONNECTED  # from its goodbye on, not online
        stopping.set()
        tasks.cancel_scope.cancel()  # the watch of exits runs until cancelled
