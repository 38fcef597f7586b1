"""Client-side limits on the listening sockets: slow requests are cut and counted, connections are capped.

A real CapyCTL with short client timeouts and a small connection cap, before
the broken engine stand-in (serving its healthy ``ok`` case). Clients here
are raw sockets, so a request can stop halfway through its headers or body.
"""

from __future__ import annotations

import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fakes.broken_engine import BrokenEngine
from tests.integration.harness import CapyServer

pytestmark = pytest.mark.integration
ULID = re.compile(rb"x-capyctl-request-id: [0-9A-HJKMNP-TV-Z]{26}\r\n")


def serve(tmp: Path, engine: BrokenEngine, *args: str) -> CapyServer:
    server = CapyServer(tmp / "state", *args).start()
    try:
        doc = {"name": "ok", "engine": "vllm", "endpoint": engine.url, "engine_version": "0.32.0"}
        (tmp / "d.yaml").write_bytes(msgspec.yaml.encode(doc))
        server.cli("deploy", "model", "--file", str(tmp / "d.yaml"))
    except BaseException:
        server.stop()
        raise
    return server


@pytest.fixture(scope="module")
def impatient(tmp_path_factory: pytest.TempPathFactory, engine: BrokenEngine) -> Iterator[CapyServer]:
    server = serve(
        tmp_path_factory.mktemp("impatient"), engine, "--client-header-timeout", "1s", "--client-body-timeout", "1500ms"
    )
    try:
        yield server
    finally:
        server.stop()


def answer_of(sock: socket.socket, limit: float = 20.0) -> bytes:
    """Everything the server sends until it closes the connection (bounded by ``limit`` seconds)."""
    sock.settimeout(limit)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def envelope(raw: bytes) -> dict:
    return msgspec.json.decode(raw.split(b"\r\n\r\n", 1)[1])["error"]


def cuts(server: CapyServer) -> dict[str, float]:
    text = httpx.get(server.base_url + "/metrics", headers=server.headers(), timeout=10).text
    return {
        s.labels["reason"]: s.value
        for f in text_string_to_metric_families(text)
        if f.name == "capyctl_client_connections_cut"
        for s in f.samples
        if s.name.endswith("_total")
    }


@pytest.mark.parametrize(
    ("sent", "phase"),
    [
        (b"", "headers"),  # connects and says nothing
        (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthori", "headers"),
        (None, "body"),  # whole headers, then a tenth of the body it announced
    ],
    ids=["silent", "half-headers", "half-body"],
)
def test_a_client_too_slow_with_its_request_is_cut_and_counted_and_costs_no_engine_work(
    impatient: CapyServer, engine: BrokenEngine, sent: bytes | None, phase: str
) -> None:
    before_requests, before_cuts = engine.stats()["requests"], cuts(impatient).get(f"slow_{phase}", 0.0)
    if sent is None:
        body = b'{"model": "ok", "messages": [{"role": "user", "content": "hi"}]}'
        sent = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {impatient.api_key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body) * 10}\r\n\r\n"
        ).encode() + body
    with socket.create_connection(("127.0.0.1", impatient.port)) as sock:
        sock.sendall(sent)
        raw = answer_of(sock)
    assert raw.startswith(b"HTTP/1.1 408 "), raw[:200]
    assert ULID.search(raw) and b"connection: close" in raw
    error = envelope(raw)
    assert error["code"] == "request_timeout" and error["phase"] == phase and phase in error["message"]
    assert cuts(impatient)[f"slow_{phase}"] == before_cuts + 1
    assert engine.stats()["requests"] == before_requests


def test_a_client_in_time_on_a_kept_alive_connection_is_not_cut(impatient: CapyServer) -> None:
    with httpx.Client(base_url=impatient.base_url, headers=impatient.headers(), timeout=30) as client:
        for stream in (False, True, False):  # one connection, several requests
            r = client.post("/v1/chat/completions", json={"model": "ok", "messages": [], "stream": stream})
            assert r.status_code == 200
            assert r.text.endswith("data: [DONE]\n\n") if stream else r.json()["choices"]


def test_the_next_request_on_a_kept_alive_connection_gets_its_own_header_time(impatient: CapyServer) -> None:
    """After an answered request the connection's header time starts again with the next request's first
    byte: a pause before it is the keep-alive's business, a stall inside its headers is cut."""
    body = b'{"model": "ok", "messages": []}'
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {impatient.api_key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    with socket.create_connection(("127.0.0.1", impatient.port)) as sock:
        sock.sendall(request)
        first = b""
        while b"\r\n\r\n" not in first or len(first.split(b"\r\n\r\n", 1)[1]) < int(
            re.search(rb"content-length: (\d+)", first).group(1)
        ):  # type: ignore[union-attr]
            first += sock.recv(65536)
        assert first.startswith(b"HTTP/1.1 200 ")
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthori")  # and no more
        raw = answer_of(sock)
    assert raw.startswith(b"HTTP/1.1 408 "), raw[:200]
    assert envelope(raw)["phase"] == "headers"


def chat(server: CapyServer) -> httpx.Response:
    try:
        return httpx.post(
            server.base_url + "/v1/chat/completions",
            headers=server.headers(),
            timeout=30,
            json={"model": "ok", "messages": []},
        )
    except httpx.RemoteProtocolError:  # refused before httpx read a whole answer: as good as a 503 here
        return httpx.Response(503)


def test_connections_past_the_cap_are_refused_with_a_clear_answer(tmp_path: Path, engine: BrokenEngine) -> None:
    server = serve(tmp_path, engine, "--max-connections", "4")
    held: list[socket.socket] = []
    try:
        for _ in range(4):
            held.append(socket.create_connection(("127.0.0.1", server.port)))
        with socket.create_connection(("127.0.0.1", server.port)) as extra:
            raw = answer_of(extra)
        assert raw.startswith(b"HTTP/1.1 503 "), raw[:200]
        assert b"retry-after: 1\r\n" in raw and ULID.search(raw)
        error = envelope(raw)
        assert error["code"] == "too_many_connections" and error["limit"] == 4
        assert "--max-connections" in error["message"]
        for sock in held:
            sock.close()
        held.clear()
        deadline = time.monotonic() + 10  # once the server has seen the closes, it serves again
        while (r := chat(server)).status_code == 503 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert r.status_code == 200
        assert cuts(server)["too_many_connections"] == 1
    finally:
        for sock in held:
            sock.close()
        server.stop()
