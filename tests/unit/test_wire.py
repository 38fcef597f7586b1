"""The engine stream client, pumped: whole streams, kept-alive connections, clean cuts, a paused engine.

Two engines answer over real sockets: the replay engine (``capyctl.replay``,
a recording at full speed or paced) and ``Engine`` below, in the test's own
loop, which writes what each test tells it to, when it tells it to, and
notes when CapyCTL closes the connection. Every wait is bounded, and what must
not have happened is checked only once a positive signal says it had the
chance to (the engine's bytes waiting in CapyCTL's socket, or read by it).
"""

from __future__ import annotations

import asyncio
import fcntl
import random
import re
import struct
import subprocess
import sys
import termios
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from capyctl.adapters.engines._wire import WireEngineSession, _Response
from capyctl.domain.errors import EdgeError, EngineError, EngineUnavailable
from capyctl.domain.lifecycle import EngineAddress
from capyctl.domain.streams import DONE, Chunks, Comment, Relayed, StreamEvent
from tests.fakes.answers import pump_all

RECORDING = Path(__file__).parents[1] / "contract" / "recordings" / "vllm" / "0.32.0"
BODY = b'{"model":"x","stream":true,"messages":[],"replay_case":"chat_stream_usage"}'
SLOW = BODY[:-1] + b',"replay_interval_ms":20}'
HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
END = b"0\r\n\r\n"  # the last chunk: the answer's end


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


def event(n: int) -> bytes:
    return b'data: {"n":%d}\n\n' % n


def carried(events: list[StreamEvent]) -> list[tuple[Any, ...]]:
    """What events carry, whatever their batching: ("data", payload) each, ("comment", raw), ("done",)."""
    out: list[tuple[Any, ...]] = []
    for e in events:
        if isinstance(e, Chunks):
            out += [("data", payload) for payload in e.payload_list()]
        elif isinstance(e, Comment):
            out.append(("comment", e.raw))
        else:
            out.append(("done",))
    return out


def recorded() -> list[tuple[Any, ...]]:
    data = (RECORDING / "chat_stream_usage.sse").read_bytes()
    return [("done",) if block == b"data: [DONE]" else ("data", block[6:]) for block in data.split(b"\n\n") if block]


def unread(conn: _Response) -> int:
    """Bytes the engine sent that wait in CapyCTL's socket, not yet read."""
    sock = conn.transport.get_extra_info("socket")  # type: ignore[union-attr]
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]


async def until(check: Callable[[], Any], what: str, timeout: float = 5.0) -> Any:
    """Poll ``check`` until it is truthy; fail after ``timeout`` seconds."""
    try:
        with anyio.fail_after(timeout):
            while not (value := check()):
                await anyio.sleep(0.002)
    except TimeoutError:
        raise AssertionError(f"timed out after {timeout} s waiting for {what}") from None
    return value


# --- the replay engine ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def replay() -> Iterator[str]:
    process = subprocess.Popen(
        [sys.executable, "-m", "capyctl.replay", "--dialect", "vllm", "--recordings", str(RECORDING), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        line = process.stdout.readline().decode()  # type: ignore[union-attr]
        match = re.search(r"listening on (http://\S+)", line)
        assert match, line
        yield match.group(1)
    finally:
        process.terminate()
        process.wait(10)


def key_of(url: str) -> tuple[str, int]:
    return "127.0.0.1", int(url.rsplit(":", 1)[1])


def disconnected(url: str) -> int:
    return httpx.get(url + "/replay/stats", trust_env=False).json()["disconnected"]


async def pumped(session: WireEngineSession, url: str, body: bytes = BODY) -> tuple[list[list[StreamEvent]], bool]:
    """(each batch delivered, what pump returned); delivery says ENDED at [DONE], never FULL."""
    return await pump_all(session, url, body)


async def test_streams_are_whole_and_connections_are_reused(replay: str) -> None:
    session = WireEngineSession()
    for _ in range(3):
        batches, ended = await pumped(session, replay)
        assert ended and carried([e for batch in batches for e in batch]) == recorded()
        assert len(session._idle[key_of(replay)]) == 1  # the one connection went back to the pool, every time
    connection = session._idle[key_of(replay)][0]
    await pumped(session, replay)
    assert session._idle[key_of(replay)] == [connection]


async def test_a_paced_stream_comes_in_many_batches_and_carries_the_same(replay: str) -> None:
    session = WireEngineSession()
    batches, ended = await pumped(session, replay, BODY[:-1] + b',"replay_interval_ms":1}')
    assert ended and carried([e for batch in batches for e in batch]) == recorded()
    assert len(batches) > 1 and all(batch for batch in batches)  # a batch per read; never an empty one
    assert len(session._idle[key_of(replay)]) == 1


async def test_leaving_after_a_delivery_that_said_ended_closes_the_connection(replay: str) -> None:
    session = WireEngineSession()
    before = disconnected(replay)
    delivered: list[int] = []

    def deliver(batch: list[StreamEvent]) -> Relayed:
        delivered.append(len(batch))
        return Relayed.ENDED  # the client went away after the first batch

    with anyio.fail_after(10):
        async with session.chat_stream(EngineAddress(replay), SLOW) as answer:
            assert await answer.pump(deliver, anyio.sleep) is True
    assert delivered == [1]  # pump returned at ENDED: nothing more was asked of deliver
    assert session._idle.get(key_of(replay), []) == []
    await until(lambda: disconnected(replay) > before, "the replay engine to see the connection closed")


async def test_a_cut_pump_delivers_nothing_more_and_closes_its_connection(replay: str) -> None:
    session = WireEngineSession()
    before = disconnected(replay)
    delivered: list[int] = []
    with anyio.fail_after(10), anyio.CancelScope() as cut:

        def deliver(batch: list[StreamEvent]) -> Relayed:
            delivered.append(len(batch))
            cut.cancel()  # as the client's hang-up would
            return Relayed.MORE

        async with session.chat_stream(EngineAddress(replay), SLOW) as answer:
            await answer.pump(deliver, anyio.sleep)
    assert cut.cancelled_caught and delivered == [1]
    await until(lambda: disconnected(replay) > before, "the replay engine to see the connection closed")


async def test_a_cut_connection_is_replaced_by_an_idle_one_that_the_next_request_goes_out_on(replay: str) -> None:
    session = WireEngineSession()
    with anyio.fail_after(10), anyio.CancelScope() as cut:

        def deliver(batch: list[StreamEvent]) -> Relayed:
            cut.cancel()  # the client hung up after the first batch: its request is cancelled
            return Relayed.MORE

        async with session.chat_stream(EngineAddress(replay), SLOW) as answer:
            await answer.pump(deliver, anyio.sleep)
    assert cut.cancelled_caught
    # the cut one was closed; a new one comes to stand idle in its place
    await until(lambda: session._idle.get(key_of(replay)), "a spare connection to stand idle")
    spare = session._idle[key_of(replay)][0]
    batches, ended = await pumped(session, replay)
    assert ended and carried([e for batch in batches for e in batch]) == recorded()
    assert session._idle[key_of(replay)] == [spare]  # the request went out on it, and it is kept for the next


async def test_a_pooled_connection_the_engine_closed_is_passed_over_for_a_new_one(replay: str) -> None:
    session = WireEngineSession()
    await pumped(session, replay)
    stale = session._idle[key_of(replay)][0]
    stale.transport.abort()  # type: ignore[union-attr]  # as if the engine had closed it while it stood idle
    batches, ended = await pumped(session, replay)
    assert ended and carried([e for batch in batches for e in batch]) == recorded()
    assert session._idle[key_of(replay)] and session._idle[key_of(replay)][0] is not stale


async def test_engine_refusals_and_unreachable_engines(replay: str) -> None:
    session = WireEngineSession()
    with anyio.fail_after(10):
        with pytest.raises(EngineError) as refused:
            async with session.chat_stream(
                EngineAddress(replay), BODY.replace(b"chat_stream_usage", b"error_bad_messages")
            ):
                pass
        assert refused.value.status == 400
        with pytest.raises(EngineUnavailable, match="could not reach"):
            async with session.chat_stream(EngineAddress("http://127.0.0.1:9"), BODY):
                pass


# --- an engine driven step by step ----------------------------------------------------------------------


class Peer:
    """One request on CapyCTL's connection, seen from the engine: what was asked, what to write, whether
    CapyCTL has closed the connection."""

    def __init__(self, writer: asyncio.StreamWriter, request: bytes, eof: asyncio.Event) -> None:
        self.writer, self.request, self._eof = writer, request, eof

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def closed_by_client(self, timeout: float = 5.0) -> None:
        """Return once CapyCTL has closed the connection (end of file); fail after ``timeout`` seconds."""
        try:
            with anyio.fail_after(timeout):
                await self._eof.wait()
        except TimeoutError:
            raise AssertionError(f"CapyCTL did not close the connection within {timeout} s") from None


class Engine:
    """Reads each request on each connection (the connection's only reader, so that its end of file is
    seen at once) and hands it to the test as a ``Peer``."""

    def __init__(self, head: bytes | None) -> None:
        self.head = head  # written as soon as a request is read (None: the test writes it)
        self.peers: asyncio.Queue[Peer] = asyncio.Queue()
        self.writers: list[asyncio.StreamWriter] = []
        self.url = ""

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writers.append(writer)
        eof = asyncio.Event()
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(re.search(rb"Content-Length: (\d+)", head).group(1))  # type: ignore[union-attr]
                request = head + await reader.readexactly(length)
                if self.head is not None:
                    writer.write(self.head)
                self.peers.put_nowait(Peer(writer, request, eof))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            eof.set()

    async def peer(self) -> Peer:
        with anyio.fail_after(5):
            return await self.peers.get()


@asynccontextmanager
async def engine(head: bytes | None = HEAD) -> AsyncIterator[Engine]:
    served = Engine(head)
    server = await asyncio.start_server(served.serve, "127.0.0.1", 0)
    served.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        yield served
    finally:
        server.close()
        for writer in served.writers:
            writer.close()
        await server.wait_closed()


async def test_a_full_client_pauses_reading_from_the_engine_until_it_has_drained() -> None:
    session = WireEngineSession()
    batches: list[list[StreamEvent]] = []
    drained: list[str] = []
    async with engine() as served, session.chat_stream(EngineAddress(served.url), b"{}") as answer:
        peer = await served.peer()
        conn = answer._conn  # type: ignore[attr-defined]

        def deliver(batch: list[StreamEvent]) -> Relayed:
            batches.append(batch)
            if len(batches) == 1:
                return Relayed.FULL  # the first batch fills the client
            assert conn.transport.is_reading()  # reading went on once drain() returned
            return Relayed.ENDED if batch[-1] is DONE else Relayed.MORE

        async def drain() -> None:
            assert not conn.transport.is_reading()
            await peer.send(chunk(event(2) + b"data: [DONE]\n\n") + END)  # the engine goes on meanwhile
            # its bytes reach CapyCTL's socket (or, were reading not paused, CapyCTL itself) ...
            await until(lambda: unread(conn) or conn.buffered, "the engine's bytes to reach CapyCTL")
            for _ in range(5):  # ... and in the turns of the loop that would have read them, nothing is
                await asyncio.sleep(0)
            assert conn.buffered == 0 and unread(conn) > 0 and len(batches) == 1
            drained.append("drained")

        await peer.send(chunk(event(1)))
        with anyio.fail_after(10):
            assert await answer.pump(deliver, drain) is True
    assert drained == ["drained"]
    assert [carried(batch) for batch in batches] == [[("data", b'{"n":1}')], [("data", b'{"n":2}'), ("done",)]]


async def test_a_delivery_that_says_ended_stops_the_pump_and_nothing_more_is_delivered() -> None:
    session = WireEngineSession()
    delivered: list[list[StreamEvent]] = []

    def deliver(batch: list[StreamEvent]) -> Relayed:
        delivered.append(batch)
        return Relayed.ENDED

    async with engine() as served:
        async with session.chat_stream(EngineAddress(served.url), b"{}") as answer:
            peer = await served.peer()
            await peer.send(chunk(event(1)))
            with anyio.fail_after(10):
                assert await answer.pump(deliver, anyio.sleep) is True
            conn = answer._conn  # type: ignore[attr-defined]
            await peer.send(chunk(event(2)))  # the engine goes on: CapyCTL reads it, and hands it to no one
            await until(lambda: conn.buffered, "the engine's next event to reach CapyCTL")
            assert [carried(batch) for batch in delivered] == [[("data", b'{"n":1}')]]
        await peer.closed_by_client()  # leaving mid-answer closed the connection
    assert session._idle.get(key_of(served.url), []) == []


async def test_an_answer_that_ends_without_done_returns_false_with_its_last_event_delivered() -> None:
    delivered: list[StreamEvent] = []

    def deliver(batch: list[StreamEvent]) -> Relayed:
        delivered.extend(batch)
        return Relayed.MORE

    async with engine() as served:
        for last, expected in (
            (b"", [("data", b'{"n":1}')]),
            (b'data: {"n":2}', [("data", b'{"n":1}'), ("data", b'{"n":2}')]),
        ):  # unended
            delivered.clear()
            session = WireEngineSession()
            async with session.chat_stream(EngineAddress(served.url), b"{}") as answer:
                peer = await served.peer()
                await peer.send(chunk(event(1)) + (chunk(last) if last else b"") + END)
                with anyio.fail_after(10):
                    assert await answer.pump(deliver, anyio.sleep) is False
            assert carried(delivered) == expected
            assert len(session._idle[key_of(served.url)]) == 1  # a whole answer: the connection is kept


async def test_a_connection_broken_mid_answer_raises_engine_unavailable_after_what_came() -> None:
    session = WireEngineSession()
    delivered: list[StreamEvent] = []

    def deliver(batch: list[StreamEvent]) -> Relayed:
        delivered.extend(batch)
        return Relayed.MORE

    async with engine() as served:
        async with session.chat_stream(EngineAddress(served.url), b"{}") as answer:
            peer = await served.peer()
            await peer.send(chunk(event(1)) + b"40\r\ndata: {")  # an event, then half a chunk
            peer.writer.close()
            with anyio.fail_after(10), pytest.raises(EngineUnavailable, match="connection broke"):
                await answer.pump(deliver, anyio.sleep)
        assert carried(delivered) == [("data", b'{"n":1}')]
        async with session.chat_stream(EngineAddress(served.url), b"{}") as answer:  # broken before any event
            peer = await served.peer()
            peer.writer.transport.abort()
            with anyio.fail_after(10), pytest.raises(EngineUnavailable):
                await answer.pump(deliver, anyio.sleep)
    assert session._idle.get(key_of(served.url), []) == []


async def test_an_event_past_the_limit_is_an_edge_error_and_closes_the_connection() -> None:
    session = WireEngineSession(max_event=100)
    delivered: list[StreamEvent] = []
    at_limit = b'data: {"x":"' + b"a" * 86 + b'"}\n\n'  # 100 bytes but its blank line: relayed

    async with engine() as served:
        with pytest.raises(EdgeError, match="larger than the limit of 100 bytes"):
            async with session.chat_stream(EngineAddress(served.url), b"{}") as answer:
                peer = await served.peer()

                def deliver(batch: list[StreamEvent]) -> Relayed:
                    delivered.extend(batch)
                    peer.writer.write(chunk(b"a" * 60))  # the rest of the next event, in a later read: too large
                    return Relayed.MORE

                await peer.send(chunk(at_limit) + chunk(b'data: {"x":"' + b"a" * 60))
                with anyio.fail_after(10):
                    await answer.pump(deliver, anyio.sleep)
        await peer.closed_by_client()
    assert carried(delivered) == [("data", at_limit[6:-2])]


async def test_the_events_before_an_oversized_one_in_the_same_read_are_relayed_then_the_error() -> None:
    """Nothing the engine sent whole is lost to the next event's fault, and the error comes at once (the
    engine sends nothing more)."""
    session = WireEngineSession(max_event=100)
    delivered: list[StreamEvent] = []
    good = b'data: {"x":1}\n\n'

    def deliver(batch: list[StreamEvent]) -> Relayed:
        delivered.extend(batch)
        return Relayed.MORE

    async with engine() as served:
        with pytest.raises(EdgeError, match="larger than the limit of 100 bytes"):
            async with session.chat_stream(EngineAddress(served.url), b"{}") as answer:
                peer = await served.peer()
                await peer.send(chunk(good + good + b'data: {"x":"' + b"a" * 120 + b'"}\n\n'))
                with anyio.fail_after(10):
                    await answer.pump(deliver, anyio.sleep)
        await peer.closed_by_client()
    assert carried(delivered) == [("data", good[6:-2]), ("data", good[6:-2])]


def framed(body: bytes, rng: random.Random) -> bytes:
    """``body`` as a chunked HTTP body, in chunks of random sizes, some sizes in upper case or extended."""
    out: list[bytes] = []
    start = 0
    while start < len(body):
        size = min(rng.randint(1, 300), len(body) - start)
        hexa = b"%x" % size
        out.append(
            (hexa.upper() if rng.random() < 0.3 else hexa)
            + (b";x=y" if rng.random() < 0.1 else b"")
            + b"\r\n"
            + body[start : start + size]
            + b"\r\n"
        )
        start += size
    return b"".join(out) + END


def test_a_chunked_answer_is_unframed_the_same_cut_anywhere() -> None:
    body = (RECORDING / "chat_stream_usage.sse").read_bytes()[:3000]
    whole = HEAD + framed(body, random.Random(1))
    cuts = [[at] for at in range(1, len(whole))] + [list(range(1, len(whole)))]  # every seam; a byte a read
    for at in cuts:
        conn = _Response()
        unframed: list[bytes] = []
        for a, b in zip([0, *at], [*at, len(whole)], strict=True):
            conn.data_received(whole[a:b])
            if conn.headers_done:
                unframed.append(conn.take())
        assert conn.lost is None and conn.complete and conn.status == 200, at[:1]
        assert b"".join(unframed) == body, at[:1]


async def written_in_pieces(
    session: WireEngineSession, served: Engine, wire: bytes, cuts: list[int]
) -> list[StreamEvent]:
    """What the pump delivers of an answer the engine writes in pieces, ``wire`` cut at ``cuts``."""
    delivered: list[StreamEvent] = []

    def deliver(batch: list[StreamEvent]) -> Relayed:
        delivered.extend(batch)
        return Relayed.ENDED if batch[-1] is DONE else Relayed.MORE

    async def write(peer: Peer) -> None:
        for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True):
            await peer.send(wire[a:b])
            for _ in range(2):  # a turn for CapyCTL to read what came: a read per write, mostly
                await asyncio.sleep(0)

    with anyio.fail_after(10):
        async with session.chat_stream(EngineAddress(served.url), b"{}") as answer, anyio.create_task_group() as group:
            group.start_soon(write, await served.peer())
            assert await answer.pump(deliver, anyio.sleep) is True
    return delivered


async def test_a_chunked_stream_written_cut_anywhere_is_delivered_whole() -> None:
    session = WireEngineSession()
    data = (RECORDING / "chat_stream_usage.sse").read_bytes()
    rng = random.Random(29)
    async with engine() as served:
        for _ in range(20):
            wire = framed(data, rng)
            delivered = await written_in_pieces(session, served, wire, sorted(rng.sample(range(1, len(wire)), 60)))
            assert carried(delivered) == recorded()
    assert len(session._idle[key_of(served.url)]) == 1  # one kept-alive connection served them all


async def test_each_request_leaves_with_the_head_for_its_engine_address() -> None:
    """The head is worked out once per engine address (path prefix, host, port and Accept kept), with each
    request's own Content-Length."""
    session = WireEngineSession()
    refusal = b"HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
    async with engine(refusal) as served:
        for body in (b'{"a":1}', b'{"bb":22}'):
            with pytest.raises(EngineError):
                async with session.chat_stream(EngineAddress(f"{served.url}/engine/"), body):
                    pass
        with pytest.raises(EngineError):
            await session.decide(EngineAddress(served.url), b'{"q":1}')
        heads = [(await served.peer()).request for _ in range(3)]
    port = served.url.rsplit(":", 1)[1]
    prefix = f"Host: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
    assert heads == [
        f"POST /engine/v1/chat/completions HTTP/1.1\r\n{prefix}Accept: text/event-stream\r\n"
        f"Content-Length: 7\r\n\r\n".encode()
        + b'{"a":1}',
        f"POST /engine/v1/chat/completions HTTP/1.1\r\n{prefix}Accept: text/event-stream\r\n"
        f"Content-Length: 9\r\n\r\n".encode()
        + b'{"bb":22}',
        f"POST /v1/systemone HTTP/1.1\r\n{prefix}Accept: application/json\r\nContent-Length: 7\r\n\r\n".encode()
        + b'{"q":1}',
    ]
