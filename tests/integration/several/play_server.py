"""A test playing the server's part on the control link, so that it holds what only a server holds: the caller
certificate a host's ingress lets in, and the gate key of a launch. Run inside the server's namespace:

    python -m tests.integration.several.play_server DIR ADVERTISED:PORT VENV MODEL TIMELINE

It is CapyCTL's own server side, on fakes for storage: a CA in ``DIR/ca``, the registry of hosts and the
control listener on 0.0.0.0:PORT. It writes ``DIR/gpu-a.join`` for the test to join a real ``capyctl start
host`` with, waits for that host's link, registers the stand-in vLLM of ``VENV`` there, launches it with a gate
key of its own and waits until a probe finds it ready. Then it sends the ingress, over mutual TLS with the
caller certificate and that gate key, what a faulty or hostile caller would (a short body, a bare LF, a
``Content-Length: +100``, two requests pipelined), writes what came back to ``DIR/results.json``, and waits
to be stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import ssl
import sys
from pathlib import Path
from typing import Any

import anyio
import msgspec

from capyctl.adapters.control.host_agent import SERVER_NAME
from capyctl.adapters.control.server_listener import ControlListener
from capyctl.adapters.pki import CertificateAuthority, caller_certificate, client_ssl_context, server_ssl_context
from capyctl.domain.hosts import HostState, LinkTimings
from capyctl.domain.joining import JoinFile, secret_text
from capyctl.services.events import Events
from capyctl.services.fleet import decode_spec
from capyctl.services.server_hosts import HostRegistry
from tests.fakes.ports import FakeClock, FakeStore

GATE = "p" * 32
BODY = msgspec.json.encode({"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})


def post(body: bytes, length: str | None = None, end: bytes = b"\r\n") -> bytes:
    lines = [
        b"POST /v1/chat/completions HTTP/1.1",
        b"Host: gpu-a",
        b"Content-Type: application/json",
        b"X-CapyCTL-Gate: " + GATE.encode(),
        b"Content-Length: " + (length or str(len(body))).encode(),
    ]
    return end.join(lines) + end + end + body


async def exchange(address: str, port: int, tls: ssl.SSLContext, data: bytes, answers: int = 1) -> list[int]:
    """``data`` written at once; the statuses of the answers that came (up to ``answers``) before the ingress
    closed the connection or 20 s passed."""
    reader, writer = await asyncio.open_connection(address, port, ssl=tls, server_hostname="gpu-a")
    writer.write(data)
    statuses: list[int] = []
    try:
        async with asyncio.timeout(20):
            while len(statuses) < answers:
                head = await reader.readuntil(b"\r\n\r\n")
                statuses.append(int(head.split(b" ")[1]))
                fields = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:] if b": " in line)
                length = fields.get(b"Content-Length") or fields.get(b"content-length")
                if length is not None:
                    await reader.readexactly(int(length))
                else:  # a stream, chunked: read to its last chunk
                    await reader.readuntil(b"0\r\n\r\n")
    except (asyncio.IncompleteReadError, TimeoutError, ConnectionError):
        pass
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
    return statuses


async def main(root: Path, advertised: str, venv: str, model: str, timeline: str) -> None:
    authority = CertificateAuthority.load_or_create(root / "ca")
    cert, key = authority.server_certificate([SERVER_NAME])
    caller, caller_key = caller_certificate(SERVER_NAME)
    store, clock = FakeStore(), FakeClock()
    registry = HostRegistry(store, clock, Events(store, clock), LinkTimings())
    control = socket.create_server(("0.0.0.0", int(advertised.rsplit(":", 1)[1])))
    secret = bytes(range(32))
    invite = registry.invite("gpu-a", secret, ttl=600)
    join = JoinFile(
        host="gpu-a",
        server=advertised,
        ca_pem=authority.cert_pem.decode(),
        secret=secret_text(secret),
        expires_at=invite.expires_at,
    )
    (root / "gpu-a.join").write_bytes(msgspec.json.encode(join))
    stopping = anyio.Event()
    async with anyio.create_task_group() as tasks:
        listener = ControlListener(
            registry, authority, server_ssl_context(cert, key, authority.cert_pem, False), caller
        )
        tasks.start_soon(listener.serve, control, stopping)
        with anyio.fail_after(60):  # joined, then linked
            while registry.views() == [] or registry.view("gpu-a")["state"] != HostState.ONLINE:
                await anyio.sleep(0.1)
        engine = await registry.add_engine("gpu-a", venv, "vllm", None)
        spec = decode_spec(
            {
                "name": "chat",
                "engine": "vllm",
                "model": model,
                "engine_config": {"env": {"STANDIN_TIMELINE": timeline, "STANDIN_HEADS": "1"}},
            }
        )
        args = {"spec": msgspec.to_builtins(spec), "engine": msgspec.to_builtins(engine), "gate": GATE}
        launched = await registry.command("gpu-a", "launch", args, instance="chat", generation=1)
        assert launched.ok, launched
        with anyio.fail_after(60):
            while not (await registry.command("gpu-a", "probe", {}, instance="chat", generation=1)).detail["ready"]:
                await anyio.sleep(0.2)
        address, port = registry.ingress("gpu-a")
        tls = client_ssl_context(authority.cert_pem, caller, caller_key, server_name="gpu-a")
        results: dict[str, Any] = {
            "whole": await exchange(address, port, tls, post(BODY)),
            "short_body": await exchange(address, port, tls, post(BODY[:10], length="100")),
            "bare_lf": await exchange(address, port, tls, post(BODY, end=b"\n")),
            "plus_length": await exchange(address, port, tls, post(BODY, length=f"+{len(BODY)}")),
            "pipelined": await exchange(address, port, tls, post(BODY) + post(BODY), answers=2),
        }
        (root / "results.json").write_text(json.dumps(results))
        await anyio.sleep_forever()


if __name__ == "__main__":
    anyio.run(main, Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5])
