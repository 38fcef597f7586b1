"""The hot paths answered on the wire: HTTP/1.1 as a client may speak it, over a raw socket.

Chat and decisions skip the ASGI layer (``WireExchange``); these tests hold that
what a client sees is still plain, correct HTTP/1.1: kept-alive connections
serving request after request, pipelined requests answered in order,
``Expect: 100-continue`` honoured, HTTP/1.0 answered and closed, and the same
answer through an escaped path (which takes the ASGI way).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from tests.integration.harness import CapyServer, replay_behind_capyctl

RECORDING = Path(__file__).parents[1] / "contract" / "recordings" / "vllm" / "0.32.0"
CHUNKS = (RECORDING / "chat_stream_eos_stop.sse").read_bytes().count(b"data: {")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CapyServer]:
    with replay_behind_capyctl(
        tmp_path_factory.mktemp("wire"), RECORDING, "--default-case", "chat_stream_eos_stop"
    ) as capy:
        yield capy


def request(
    server: CapyServer, body: dict, version: str = "1.1", path: str = "/v1/chat/completions", extra: str = ""
) -> tuple[bytes, bytes]:
    data = msgspec.json.encode(body)
    head = (
        f"POST {path} HTTP/{version}\r\nHost: x\r\nAuthorization: Bearer {server.api_key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n{extra}\r\n"
    ).encode()
    return head, data


class Reader:
    """HTTP/1.1 answers read off one socket, one after the other (chunked or with a length)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def _more(self, deadline: float) -> None:
        self.sock.settimeout(max(0.01, deadline - time.monotonic()))
        data = self.sock.recv(65536)
        if not data:
            raise EOFError("the server closed the connection")
        self.buffer += data

    def until(self, marker: bytes, within: float = 10) -> bytes:
        deadline = time.monotonic() + within
        while marker not in self.buffer:
            self._more(deadline)
        found, self.buffer = self.buffer.split(marker, 1)
        return found + marker

    def answer(self, within: float = 10) -> tuple[str, dict[str, str], bytes]:
        head = self.until(b"\r\n\r\n", within).decode()
        status, *lines = head.strip().split("\r\n")
        headers = {k.lower(): v for k, v in (line.split(": ", 1) for line in lines)}
        if headers.get("transfer-encoding") == "chunked":
            body = b""
            while True:
                size = int(self.until(b"\r\n", within)[:-2], 16)
                deadline = time.monotonic() + within
                while len(self.buffer) < size + 2:
                    self._more(deadline)
                body, self.buffer = body + self.buffer[:size], self.buffer[size + 2 :]
                if size == 0:
                    return status, headers, body
        length = int(headers["content-length"])
        deadline = time.monotonic() + within
        while len(self.buffer) < length:
            self._more(deadline)
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return status, headers, body


STREAM = {"model": "chat", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
WHOLE = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}


def test_one_connection_serves_streams_answers_and_errors_one_after_the_other(server: CapyServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        reader = Reader(sock)
        ids = set()
        for body in (STREAM, WHOLE, {"model": "nope", "messages": []}, STREAM):
            sock.sendall(b"".join(request(server, body)))
            status, headers, payload = reader.answer()
            ids.add(headers["x-capyctl-request-id"])
            assert "connection" not in headers  # kept alive
            if body is STREAM:
                assert status == "HTTP/1.1 200 OK" and headers["content-type"] == "text/event-stream"
                assert payload.count(b"data: {") == CHUNKS and payload.endswith(b"data: [DONE]\n\n")
            elif body is WHOLE:
                assert status == "HTTP/1.1 200 OK" and msgspec.json.decode(payload)["object"] == "chat.completion"
            else:
                assert status == "HTTP/1.1 404 Not Found"
                assert msgspec.json.decode(payload)["error"]["code"] == "model_not_found"
        assert len(ids) == 4


def test_pipelined_requests_are_answered_in_order(server: CapyServer) -> None:
    slow = {**STREAM, "replay_interval_ms": 40}  # the first takes longest: answered at once, they would overtake it
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(
            b"".join(request(server, slow)) + b"".join(request(server, WHOLE)) + b"".join(request(server, STREAM))
        )
        reader = Reader(sock)
        kinds = []
        for _ in range(3):
            status, headers, payload = reader.answer()
            assert status == "HTTP/1.1 200 OK"
            kinds.append(headers["content-type"])
            if headers["content-type"] == "text/event-stream":
                assert payload.count(b"data: {") == CHUNKS
        assert kinds == ["text/event-stream", "application/json", "text/event-stream"]


def test_expect_100_continue_gets_its_interim_answer_before_the_body_is_sent(server: CapyServer) -> None:
    head, data = request(server, STREAM, extra="Expect: 100-continue\r\n")
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(head)
        reader = Reader(sock)
        assert reader.until(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(data)
        status, _, payload = reader.answer()
        assert status == "HTTP/1.1 200 OK" and payload.count(b"data: {") == CHUNKS


def test_an_http_1_0_client_gets_its_answer_and_the_connection_closed(server: CapyServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"".join(request(server, WHOLE, version="1.0")))
        reader = Reader(sock)
        status, headers, payload = reader.answer()
        assert status == "HTTP/1.1 200 OK" and headers["connection"] == "close"
        assert msgspec.json.decode(payload)["object"] == "chat.completion"
        with pytest.raises(EOFError):
            reader.until(b"never")


def test_an_escaped_path_takes_the_asgi_way_to_the_same_answer(server: CapyServer) -> None:
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"".join(request(server, STREAM, path="/v1/chat%2Fcompletions")))
        status, headers, payload = Reader(sock).answer()
        assert status == "HTTP/1.1 200 OK" and headers["content-type"] == "text/event-stream"
        assert payload.count(b"data: {") == CHUNKS and len(headers["x-capyctl-request-id"]) == 26
