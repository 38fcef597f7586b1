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
from capyctl.domain.streams import Chunk, Done, Relayed

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



# --- pumped: each read relayed from the connection's callback --------------------------------------------


async def pumped(session: WireEngineSession, url: str, body: bytes = BODY) -> tuple[list, list[int], bool]:
    """(every event delivered, each batch's size, whether the pump ended on a delivery that said ENDED)."""
    events: list = []
    sizes: list[int] = []

    def deliver(batch: list) -> Relayed:
        events.extend(batch)
        sizes.append(len(batch))
        return Relayed.ENDED if isinstance(batch[-1], Done) else Relayed.MORE

    async def drain() -> None:
        raise AssertionError("nothing said FULL")

    async with session.chat_stream(url, body) as stream:
        ended = await stream.pump(deliver, drain)
    return events, sizes, ended


async def test_a_pumped_stream_delivers_what_a_pulled_one_yields(replay: str) -> None:
    session = WireEngineSession()
    pulled = await read_all(session, replay)
    for body in (BODY, BODY[:-1] + b',"replay_interval_ms":1}'):  # read whole; a read per event or so
        events, sizes, ended = await pumped(session, replay, body)
        assert ended and [type(e) for e in events] == [type(e) for e in pulled]
        assert [e.raw for e in events if isinstance(e, Chunk)] == [e.raw for e in pulled if isinstance(e, Chunk)]
    assert len(sizes) > 1  # (the slow one came in several reads)
    assert len(session._idle[("127.0.0.1", int(replay.rsplit(":", 1)[1]))]) == 1  # kept alive, as pulled


async def test_a_pumped_stream_comes_one_event_at_a_time_until_the_first_token(replay: str) -> None:
    session = WireEngineSession()
    sizes: list[int] = []

    def deliver(batch: list) -> Relayed:
        sizes.append(len(batch))
        return Relayed.ENDED if isinstance(batch[-1], Done) else Relayed.MORE

    async with session.chat_stream(replay, BODY, lambda: len(sizes) >= 3) as stream:
        assert await stream.pump(deliver, anyio.sleep)
    assert sizes[:3] == [1, 1, 1] and sum(sizes) == expected_chunks() + 1 and len(sizes) < sum(sizes) - 3


async def test_a_full_client_pauses_reading_from_the_engine_until_it_has_drained(replay: str) -> None:
    session = WireEngineSession()
    events: list = []
    reading: list[bool] = []

    def deliver(batch: list) -> Relayed:
        events.extend(batch)
        if isinstance(batch[-1], Done):
            return Relayed.ENDED
        return Relayed.FULL if len(events) == len(batch) else Relayed.MORE  # the first batch fills the client

    async with session.chat_stream(replay, BODY[:-1] + b',"replay_interval_ms":2}') as stream:
        async def drain() -> None:
            reading.append(stream._conn.transport.is_reading())
            delivered = len(events)
            await anyio.sleep(0.05)  # the engine sends an event every 2 ms: none may be delivered meanwhile
            assert len(events) == delivered

        assert await stream.pump(deliver, drain)
    assert reading == [False] and len(events) == expected_chunks() + 1  # paused while full; nothing lost


async def test_a_cut_pump_delivers_nothing_more_and_closes_its_connection(replay: str) -> None:
    session = WireEngineSession()
    before = httpx.get(replay + "/replay/stats").json()["disconnected"]
    delivered: list[int] = []
    with anyio.CancelScope() as cut:
        def deliver(batch: list) -> Relayed:
            delivered.append(len(batch))
            cut.cancel()  # as the client's hang-up would
            return Relayed.MORE

        async with session.chat_stream(replay, BODY[:-1] + b',"replay_interval_ms":20}') as stream:
            await stream.pump(deliver, anyio.sleep)
    assert cut.cancelled_caught and delivered == [1]
    with anyio.fail_after(2):
        while httpx.get(replay + "/replay/stats").json()["disconnected"] == before:
            await anyio.sleep(0.02)


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


class _Conn:
    saw_done = False


def _feed_only() -> type:
    from capyctl.adapters.engines import _sse

    class FeedOnly(_sse.SseParser):
        __slots__ = ()

        def lone(self, data: bytes) -> object:
            return _sse.MANY  # every read the general way

        def runs(self, data: bytes) -> object:
            return _sse.MANY

    return FeedOnly


_FeedOnly = _feed_only()


@pytest.mark.parametrize("answered_after", [0, 3, 100])
def test_a_stream_read_a_token_a_read_comes_in_the_same_batches_as_through_feed(answered_after: int) -> None:
    """Reads of one whole event each (a stream at a model's pace) take the parser's one-event way; the
    batches, the one-at-a-time start and the end are what the general way gives for the same reads."""
    from capyctl.adapters.engines import _sse
    from capyctl.adapters.engines._wire import _Reads

    data = (RECORDING / "chat_stream_usage.sse").read_bytes()
    reads = [event + b"\n\n" for event in data.split(b"\n\n") if event]
    reads.insert(5, reads[5] + reads[6])  # one read of two events among them
    del reads[6:8]
    assert len(reads) > 100 and reads[-1] == b"data: [DONE]\n\n"

    def batches(one_way: bool) -> tuple[list[list[str]], bool, int]:
        conn = _Conn()
        seen: list[list[str]] = []
        reads_ = _Reads(conn, _sse.DEFAULT_MAX_EVENT, lambda: len(seen) >= answered_after, runs=True)
        if not one_way:
            reads_.parser = _FeedOnly(_sse.DEFAULT_MAX_EVENT, runs=True)
        for read in reads:
            for batch in reads_.batches(read):
                seen.append([type(event).__name__ + ":" + repr(getattr(event, "raw", b""))[:40] for event in batch])
        return seen, conn.saw_done, reads_.singly

    assert batches(True) == batches(False)
    seen, saw_done, _ = batches(True)
    assert seen[-1] == ["Done:b''"] and saw_done


@pytest.mark.parametrize("per_read", [2, 7, 40])
@pytest.mark.parametrize("answered_after", [0, 3])
def test_a_stream_read_many_events_a_read_comes_in_the_same_batches_as_through_feed(per_read: int,
                                                                                    answered_after: int) -> None:
    """Reads of several whole events (an engine at full speed) take the parser's Run way; the batches, the
    one-at-a-time start and the end are what the general way gives for the same reads."""
    from capyctl.adapters.engines import _sse
    from capyctl.adapters.engines._wire import _Reads

    events = [event + b"\n\n" for event in (RECORDING / "chat_stream_usage.sse").read_bytes().split(b"\n\n") if event]
    reads = [b"".join(events[i:i + per_read]) for i in range(0, len(events), per_read)]
    reads[3:4] = [reads[3][:17], reads[3][17:]]  # one read that ends inside an event, and the next
    reads[-1:] = [reads[-1][:-14], reads[-1][-14:]] if per_read == 40 else reads[-1:]  # [DONE] alone, once

    def batches(fast: bool) -> tuple[list[list[str]], bool]:
        conn = _Conn()
        seen: list[list[str]] = []
        reads_ = _Reads(conn, _sse.DEFAULT_MAX_EVENT, lambda: len(seen) >= answered_after, runs=True)
        if not fast:
            reads_.parser = _FeedOnly(_sse.DEFAULT_MAX_EVENT, runs=True)
        for read in reads:
            for batch in reads_.batches(read):
                seen.append([type(event).__name__ + ":" + repr(getattr(event, "sse", getattr(event, "raw", b"")))
                             for event in batch])
        return seen, conn.saw_done

    assert batches(True) == batches(False)
    seen, saw_done = batches(True)
    assert saw_done and seen[-1][-1] == "Done:b''"
    assert sum(kind.startswith("Run:") for batch in seen for kind in batch) >= len(reads) // 2
