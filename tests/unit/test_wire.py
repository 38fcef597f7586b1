"""The engine stream client on a real replay engine: whole streams, kept-alive connections, clean cuts."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx
import pytest

from capyctl.adapters.engines._wire import WireEngineSession
from capyctl.domain.errors import EngineError, EngineUnavailable
from capyctl.domain.streams import Chunk, Done

RECORDING = Path(__file__).parents[1] / "contract" / "recordings" / "vllm" / "0.32.0"
BODY = b'{"model":"x","stream":true,"messages":[],"replay_case":"chat_stream_usage"}'


@pytest.fixture(scope="module")
def replay() -> Iterator[str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "capyctl.replay", "--dialect", "vllm", "--recordings", str(RECORDING), "--port", "0"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    try:
        line = process.stdout.readline().decode()  # type: ignore[union-attr]
        match = re.search(r"listening on (http://\S+)", line)
        assert match, line
        yield match.group(1)
    finally:
        process.terminate()
        process.wait(10)


def expected_chunks() -> int:
    return (RECORDING / "chat_stream_usage.sse").read_bytes().count(b"data: {")


async def read_all(session: WireEngineSession, url: str, body: bytes = BODY) -> list:
    events = []
    async with session.chat_stream(url, body) as batches:
        async for batch in batches:
            events += batch
    return events


async def test_streams_are_whole_and_connections_are_reused(replay: str) -> None:
    session = WireEngineSession()
    for _ in range(3):
        events = await read_all(session, replay)
        assert sum(isinstance(e, Chunk) for e in events) == expected_chunks()
        assert isinstance(events[-1], Done)
        idle = session._idle[("127.0.0.1", int(replay.rsplit(":", 1)[1]))]
        assert len(idle) == 1  # the one connection went back to the pool, every time
    connection = idle[0]
    await read_all(session, replay)
    assert session._idle[("127.0.0.1", int(replay.rsplit(":", 1)[1]))] == [connection]


async def test_a_cut_stream_closes_its_connection(replay: str) -> None:
    session = WireEngineSession()
    before = httpx.get(replay + "/replay/stats").json()["disconnected"]
    slow = BODY[:-1] + b',"replay_interval_ms":20}'
    async with session.chat_stream(replay, slow) as batches:
        async for _ in batches:
            break  # the client went away after the first batch
    assert session._idle.get(("127.0.0.1", int(replay.rsplit(":", 1)[1])), []) == []
    with anyio.fail_after(2):
        while httpx.get(replay + "/replay/stats").json()["disconnected"] == before:
            await anyio.sleep(0.02)


async def test_a_cut_connection_is_replaced_by_an_idle_one_that_the_next_request_goes_out_on(replay: str) -> None:
    session = WireEngineSession()
    key = ("127.0.0.1", int(replay.rsplit(":", 1)[1]))
    slow = BODY[:-1] + b',"replay_interval_ms":20}'
    with anyio.CancelScope() as cut:
        async with session.chat_stream(replay, slow) as batches:
            async for _ in batches:
                cut.cancel()  # the client hung up after the first batch: its request is cancelled
    assert cut.cancelled_caught
    with anyio.fail_after(5):  # the cut one was closed; a new one comes to stand idle in its place
        while not session._idle.get(key):
            await anyio.sleep(0.01)
    spare = session._idle[key][0]
    events = await read_all(session, replay)
    assert sum(isinstance(e, Chunk) for e in events) == expected_chunks()
    assert isinstance(events[-1], Done)
    assert session._idle[key] == [spare]  # the request went out on it, and it is kept alive for the next


async def test_a_pooled_connection_the_engine_closed_is_passed_over_for_a_new_one(replay: str) -> None:
    session = WireEngineSession()
    await read_all(session, replay)
    key = ("127.0.0.1", int(replay.rsplit(":", 1)[1]))
    stale = session._idle[key][0]
    stale.transport.abort()  # as if the engine had closed it while it stood idle
    events = await read_all(session, replay)
    assert sum(isinstance(e, Chunk) for e in events) == expected_chunks()
    assert session._idle[key] and session._idle[key][0] is not stale


async def test_engine_refusals_and_unreachable_engines(replay: str) -> None:
    session = WireEngineSession()
    with pytest.raises(EngineError) as refused:
        async with session.chat_stream(replay, BODY.replace(b"chat_stream_usage", b"error_bad_messages")):
            pass
    assert refused.value.status == 400
    with pytest.raises(EngineUnavailable, match="could not reach"):
        async with session.chat_stream("http://127.0.0.1:9", BODY):
            pass


async def test_the_first_events_come_one_at_a_time_until_the_caller_has_its_first_token(replay: str) -> None:
    session = WireEngineSession()
    for answered_after, singles in ((2, 2), (None, 8)):  # the first token in the 2nd event; never (at most 8)
        sizes: list[int] = []
        seen = 0

        def until() -> bool:
            return answered_after is not None and seen >= answered_after

        async with session.chat_stream(replay, BODY, until) as batches:
            async for batch in batches:
                sizes.append(len(batch))
                seen += len(batch)
        assert sizes[:singles] == [1] * singles
        assert seen == expected_chunks() + 1  # every chunk and [DONE], nothing lost or repeated
        assert len(sizes) < seen - singles  # past the first ones, a read's events come together again
    whole: list[int] = []
    async with httpx.AsyncClient(base_url=replay) as stats:
        before = (await stats.get("/replay/stats")).json()["completed"]
        async with session.chat_stream(replay, BODY) as batches:  # without until: a batch per read
            # the whole answer is in before the first batch is taken (not left to how the engine's writes and
            # this reader happen to interleave): the events read so far must come as one batch, not singly
            with anyio.fail_after(10):
                while (await stats.get("/replay/stats")).json()["completed"] == before:
                    await anyio.sleep(0.01)
            async for batch in batches:
                whole.append(len(batch))
    assert whole[0] > 1 and sum(whole) == expected_chunks() + 1



async def test_each_request_leaves_with_the_head_for_its_engine_address() -> None:
    """The head is worked out once per engine address (path prefix, host, port and Accept kept), with each
    request's own Content-Length."""
    import asyncio

    heads: list[bytes] = []

    async def engine(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(re.search(rb"Content-Length: (\d+)", head).group(1))  # type: ignore[union-attr]
        heads.append(head + await reader.readexactly(length))
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}")
        await writer.drain()

    server = await asyncio.start_server(engine, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    session = WireEngineSession()
    try:
        for body in (b'{"a":1}', b'{"bb":22}'):
            with pytest.raises(EngineError):
                async with session.chat_stream(f"http://127.0.0.1:{port}/engine/", body):
                    pass
        with pytest.raises(EngineError):
            await session.decide(f"http://127.0.0.1:{port}", b'{"q":1}')
    finally:
        server.close()
    prefix = f"Host: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
    assert heads == [
        f"POST /engine/v1/chat/completions HTTP/1.1\r\n{prefix}Accept: text/event-stream\r\n"
        f"Content-Length: 7\r\n\r\n".encode() + b'{"a":1}',
        f"POST /engine/v1/chat/completions HTTP/1.1\r\n{prefix}Accept: text/event-stream\r\n"
        f"Content-Length: 9\r\n\r\n".encode() + b'{"bb":22}',
        f"POST /v1/systemone HTTP/1.1\r\n{prefix}Accept: application/json\r\n"
        f"Content-Length: 7\r\n\r\n".encode() + b'{"q":1}',
    ]
