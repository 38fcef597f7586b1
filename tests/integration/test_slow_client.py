"""A client that reads slower than the engine writes: CapyCTL stops reading from the engine while the client's
buffers are full and goes on once they drain, and the client gets the whole stream, in order, checked.

The engine here is the replay engine serving a long synthesized vLLM stream (some megabytes, far more than
the kernel's socket buffers and CapyCTL's write buffer hold) at full speed; the client's receive buffer is
small and it reads a few kilobytes at a time.
"""

from __future__ import annotations

import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from tests.integration.harness import CapyServer, replay_behind_capyctl

RECORDING = Path(__file__).parents[1] / "contract" / "recordings" / "vllm" / "0.32.0"
REPEATS = 24_000  # content chunks: about 5 MB


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CapyServer]:
    tmp = tmp_path_factory.mktemp("slow")
    recordings = tmp / "vllm" / "0.32.0"
    shutil.copytree(RECORDING, recordings)
    events = (RECORDING / "chat_stream_usage.sse").read_bytes().split(b"\n\n")[:-1]
    content = events[1]  # a plain content chunk
    (recordings / "long.sse").write_bytes(b"\n\n".join([events[0]] + [content] * REPEATS + events[-3:]) + b"\n\n")
    with replay_behind_capyctl(tmp, recordings, "--default-case", "long", "--pace", "fast") as capy:
        yield capy


def _dechunk(body: bytes) -> bytes:
    out, i = [], 0
    while True:
        end = body.index(b"\r\n", i)
        size = int(body[i:end], 16)
        if size == 0:
            return b"".join(out)
        out.append(body[end + 2 : end + 2 + size])
        i = end + 2 + size + 2


def test_a_slow_client_gets_the_whole_stream_in_order(server: CapyServer) -> None:
    body = msgspec.json.encode({"model": "chat", "stream": True, "messages": [{"role": "user", "content": "hi"}]})
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
    sock.connect(("127.0.0.1", server.port))
    sock.sendall(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.api_key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    received = bytearray()
    deadline = time.monotonic() + 120
    sock.settimeout(30)
    while time.monotonic() < deadline:
        data = sock.recv(4096)  # a few kilobytes at a time, far slower than the engine sends
        if not data:
            break
        received += data
        time.sleep(0.0005)  # (only to be slower than the engine; nothing waits on it)
    sock.close()
    head, _, chunked = bytes(received).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    events = _dechunk(chunked).split(b"\n\n")[:-1]
    data = [e for e in events if e.startswith(b"data: {")]
    assert len(data) == REPEATS + 3  # the role chunk, every content chunk, the finish and usage chunks
    contents = [msgspec.json.decode(e[6:])["choices"][0]["delta"].get("content") for e in data[1 : REPEATS + 1]]
    assert contents == [contents[0]] * REPEATS and all(b'"model":"chat"' in e for e in data)
    assert events[-2].startswith(b": x-capyctl-metrics ") and events[-1] == b"data: [DONE]"
