"""No leak under churn: clients that hang up before the engine answers leave nothing open behind them.

A real CapyCTL in front of the broken engine (``tests/fakes/broken_engine.py``)
serves 2,000 requests, 64 at a time. About one in ten asks for
``hold_headers`` (the engine never answers) and its client hangs up after
5-50 ms; the rest are healthy answers, streamed or not, and must come back
whole. Afterwards the engine must hold no request, keep no more connections
than CapyCTL's pool had after the warm-up, and CapyCTL must have no more
file descriptors than it had then.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from tests.fakes.broken_engine import BrokenEngine
from tests.integration.harness import CapyServer

pytestmark = pytest.mark.integration

TOTAL = 2000
CONCURRENCY = 64
HOLD_SHARE = 0.10
SEED = 1729
FD_SLACK = 8
MESSAGES = [{"role": "user", "content": "Hello"}]


@dataclass(frozen=True)
class Ask:
    case: str  # "ok" or "hold_headers"
    stream: bool
    hang_up_ms: float = 0.0  # for hold_headers: when the client closes its connection


def plan(rng: random.Random) -> list[Ask]:
    asks = []
    for _ in range(TOTAL):
        stream = rng.random() < 0.5
        if rng.random() < HOLD_SHARE:
            asks.append(Ask("hold_headers", stream, rng.uniform(5, 50)))
        else:
            asks.append(Ask("ok", stream))
    return asks


def body(ask: Ask) -> dict[str, Any]:
    return {"model": "broken", "messages": MESSAGES, "stream": ask.stream, "broken_case": ask.case}


def fd_count(server: CapyServer) -> int:
    assert server.process is not None
    return len(os.listdir(f"/proc/{server.process.pid}/fd"))


@pytest.fixture
def bench(tmp_path: Path) -> Iterator[tuple[CapyServer, BrokenEngine]]:
    engine = BrokenEngine()
    server = CapyServer(tmp_path / "state")
    try:
        engine.start()
        server.start()
        path = tmp_path / "broken.yaml"
        path.write_bytes(
            msgspec.yaml.encode(
                {"name": "broken", "engine": "vllm", "endpoint": engine.url, "engine_version": "0.32.0"}
            )
        )
        server.cli("deploy", "model", "--file", str(path))
        yield server, engine
    finally:
        server.stop()
        engine.stop()


def whole_answer(ask: Ask, r: httpx.Response) -> str | None:
    """What is wrong with a healthy request's answer, None if it came back whole."""
    if r.status_code != 200:
        return f"{ask}: {r.status_code} {r.text[:200]}"
    if ask.stream:
        return None if r.text.endswith("data: [DONE]\n\n") else f"{ask}: stream cut: {r.text[-200:]!r}"
    answer = r.json()
    if answer.get("object") != "chat.completion" or answer["choices"][0]["message"]["content"] != "Hello there!":
        return f"{ask}: not a whole completion: {r.text[:200]}"
    return None


async def hang_up(server: CapyServer, ask: Ask) -> None:
    """Send a request over a raw socket and close it before any answer can come."""
    payload = msgspec.json.encode(body(ask))
    _, writer = await asyncio.open_connection("127.0.0.1", server.port)
    writer.write(
        (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
            f"Authorization: Bearer {server.api_key}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        ).encode()
        + payload
    )
    await writer.drain()
    await asyncio.sleep(ask.hang_up_ms / 1000)
    writer.close()
    await writer.wait_closed()


async def ask_whole(client: httpx.AsyncClient, ask: Ask) -> str | None:
    try:
        r = await client.post("/v1/chat/completions", json=body(ask))
    except httpx.HTTPError as exc:
        return f"{ask}: {exc!r}"
    return whole_answer(ask, r)


async def run(server: CapyServer, asks: list[Ask]) -> list[str]:
    """Every ask, CONCURRENCY at a time, on one client closed at the end; the problems of the healthy ones."""
    queue = iter(asks)
    problems: list[str] = []
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)

    async def worker(client: httpx.AsyncClient) -> None:
        for ask in queue:
            if ask.case == "hold_headers":
                await hang_up(server, ask)
            elif (problem := await ask_whole(client, ask)) is not None:
                problems.append(problem)

    async with httpx.AsyncClient(
        base_url=server.base_url, headers=server.headers(), limits=limits, timeout=30, trust_env=False
    ) as client:
        await asyncio.wait_for(asyncio.gather(*(worker(client) for _ in range(CONCURRENCY))), 120)
    return problems


def client_sockets(server: CapyServer) -> int:
    """CapyCTL's connections from clients: its sockets whose local port is its own (the listener aside).

    Measured so that client connections, which come and go, never mask or fake a leak of descriptors.
    """
    assert server.process is not None
    fds = Path(f"/proc/{server.process.pid}/fd")
    inodes = set()
    for fd in fds.iterdir():
        with contextlib.suppress(FileNotFoundError):  # closed meanwhile
            inodes.add(os.readlink(fd))
    suffix = f":{server.port:04X}"
    count = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if local.endswith(suffix) and state != "0A" and f"socket:[{inode}]" in inodes:  # 0A: LISTEN
                count += 1
    return count


def wait_until(done: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def test_clients_hanging_up_before_the_headers_leak_nothing(bench: tuple[CapyServer, BrokenEngine]) -> None:
    server, engine = bench
    warm = asyncio.run(run(server, [Ask("ok", i % 2 == 0) for i in range(CONCURRENCY)]))
    assert not warm, f"the warm-up failed: {warm[:5]}"
    assert wait_until(lambda: client_sockets(server) == 0, 5.0), "CapyCTL kept the warm-up's client connections"
    start_fds, start = fd_count(server), engine.stats()
    asks = plan(random.Random(SEED))
    began = time.monotonic()
    problems = asyncio.run(run(server, asks))
    took = time.monotonic() - began
    open_limit, fd_limit = max(start["open"], CONCURRENCY), start_fds + FD_SLACK

    def drained(stats: dict[str, Any]) -> bool:
        return (
            stats["held"] == 0
            and stats["open"] <= open_limit
            and client_sockets(server) == 0
            and fd_count(server) <= fd_limit
        )

    end = engine.wait_for(drained, 10.0)
    end_fds, clients = fd_count(server), client_sockets(server)
    holds = sum(ask.case == "hold_headers" for ask in asks)
    print(
        f"\nleaks: {len(asks)} requests ({holds} hung up) in {took:.1f} s; engine open {start['open']} -> "
        f"{end['open']}, held {end['held']}, closed_by_peer {start['closed_by_peer']} -> {end['closed_by_peer']}; "
        f"CapyCTL fds {start_fds} -> {end_fds} ({clients} client sockets left)"
    )
    assert not problems, f"{len(problems)} healthy answers were not whole, e.g. {problems[:5]}"
    assert end["held"] == 0, f"requests cut before the engine's headers left engine connections open: {end}"
    assert end["open"] <= open_limit, f"engine connections leaked: {start['open']} -> {end['open']}"
    assert end_fds <= fd_limit, f"CapyCTL's file descriptors leaked: {start_fds} -> {end_fds}"
