"""A request is written to its engine as its last byte arrives, on a connection CapyCTL keeps open.

CapyCTL closes an engine connection to cut a request (the client hung up), and
opens another to stand idle in its place; the next request goes out on that one,
with nothing else changed in what the client gets. Seen here from outside: the
TCP connections CapyCTL holds to the replay engine (``/proc/net/tcp``), and the
answers and events of the requests.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from tests.integration.harness import CapyServer

RECORDING = Path(__file__).parents[1] / "contract" / "recordings" / "vllm" / "0.32.0"
ESTABLISHED = "01"


def until(condition: Any, limit: float, what: str) -> Any:
    deadline = time.monotonic() + limit
    while not (value := condition()):
        assert time.monotonic() < deadline, what
        time.sleep(0.02)
    return value


def engine_connections(engine_port: int) -> set[int]:
    """The local ports of the established TCP connections to ``engine_port`` on this machine: CapyCTL's (its
    relay's, and its health checks'); the tests' own stats polls are closed by the time they look."""
    ports = set()
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, state = fields[1], fields[2], fields[3]
        if state == ESTABLISHED and int(remote.split(":")[1], 16) == engine_port:
            ports.add(int(local.split(":")[1], 16))
    return ports


def stream(server: CapyServer, **extra: Any) -> httpx.Response:
    body = {"model": "chat", "stream": True, "messages": [{"role": "user", "content": "hi"}], **extra}
    return httpx.post(
        server.base_url + "/v1/chat/completions",
        json=body,
        timeout=30,
        headers={"authorization": f"Bearer {server.api_key}"},
    )


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CapyServer, str, int]]:
    tmp = tmp_path_factory.mktemp("early-send")
    replay = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "capyctl.replay",
            "--recordings",
            str(RECORDING),
            "--port",
            "0",
            "--default-case",
            "chat_stream_usage",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    server: CapyServer | None = None
    try:
        url = re.search(r"listening on (http://\S+)", replay.stdout.readline().decode()).group(1)  # type: ignore[union-attr]
        server = CapyServer(tmp / "state")
        server.start()
        path = tmp / "chat.yaml"
        path.write_bytes(
            msgspec.yaml.encode({"name": "chat", "engine": "vllm", "endpoint": url, "engine_version": "0.32.0"})
        )
        server.cli("deploy", "model", "--file", str(path), "--wait")
        yield server, url, int(url.rsplit(":", 1)[1])
    finally:
        if server is not None:
            server.stop()
        replay.terminate()
        replay.wait(10)


def test_after_a_hang_up_the_next_request_goes_out_on_the_connection_opened_in_its_place(
    world: tuple[CapyServer, str, int],
) -> None:
    server, url, engine_port = world
    first = stream(server)
    assert first.status_code == 200 and first.text.endswith("data: [DONE]\n\n")
    kept = until(lambda: engine_connections(engine_port), 10, "the answered stream's connection was not kept open")

    before = httpx.get(url + "/replay/stats").json()["disconnected"]
    data = msgspec.json.encode({"model": "chat", "stream": True, "messages": [], "replay_interval_ms": 50})
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.api_key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    seen = b""
    while b"data: " not in seen:
        seen += sock.recv(65536)
    sock.close()  # hung up after the first chunk: the engine connection is closed to stop the engine
    until(
        lambda: httpx.get(url + "/replay/stats").json()["disconnected"] == before + 1,
        10,
        "the engine connection stayed open after the client left",
    )
    spare = until(lambda: engine_connections(engine_port) - kept, 10, "no connection was opened in the cut one's place")
    assert len(spare) == 1
    present = engine_connections(engine_port)
    assert len(present - spare) <= len(kept) - 1  # the cut one is gone (the others: CapyCTL's health checks)

    answered = stream(server)
    assert answered.status_code == 200
    assert answered.text.count("data: {") == first.text.count("data: {")  # the whole answer, as the first had
    assert answered.text.endswith("data: [DONE]\n\n") and ": x-capyctl-metrics " in answered.text
    assert re.fullmatch(r"[0-9A-Z]{26}", answered.headers["x-capyctl-request-id"])
    after = engine_connections(engine_port)
    assert spare <= after and after <= present  # it went out on that one (no new one), which stays open


def test_requests_that_cannot_begin_early_are_answered_as_before(world: tuple[CapyServer, str, int]) -> None:
    """With X-Request-Id, a wrong key or a bad body the front door's early start steps aside; the request's own
    task answers it, from the start."""
    server, _, _ = world
    assert stream(server).status_code == 200  # a connection idle: the early start could write at once
    body = {"model": "chat", "stream": True, "messages": []}
    named = httpx.post(
        server.base_url + "/v1/chat/completions",
        json=body,
        timeout=30,
        headers={"authorization": f"Bearer {server.api_key}", "x-request-id": "mine-1"},
    )
    assert named.status_code == 200 and named.headers["x-request-id"] == "mine-1"
    assert named.text.endswith("data: [DONE]\n\n")
    wrong = httpx.post(
        server.base_url + "/v1/chat/completions",
        json=body,
        timeout=30,
        headers={"authorization": "Bearer capy_nope_nope"},
    )
    assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
    unknown = httpx.post(
        server.base_url + "/v1/chat/completions",
        json={**body, "model": "nope"},
        timeout=30,
        headers={"authorization": f"Bearer {server.api_key}"},
    )
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    assert "early start failed" not in server.log()
