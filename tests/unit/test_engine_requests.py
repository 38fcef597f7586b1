"""The engine client's general request and the side-route helpers over it, against a real engine socket.

``WireEngineSession.request`` makes every call to an engine that is not a
streamed chat or a decision: probes, metrics reads, park and wake. These tests
hold its contract on 127.0.0.1 (``ScriptedEngine``): the status and whole body,
kept-alive connections shared with the rest, a request cut short (timeout,
cancellation, an answer too large) closing its connection and never pooled,
and what ``fetch_ok`` and ``post_ok`` make of an engine that breaks.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable

import anyio
import pytest

from capyctl.adapters.engines._http import fetch_json, fetch_ok, post_ok
from capyctl.adapters.engines._wire import _MAX_ANSWER, WireEngineSession
from capyctl.adapters.process.ports import free_port
from capyctl.domain.errors import EdgeError, EngineError, EngineUnavailable
from capyctl.domain.lifecycle import EngineAddress
from tests.fakes.scripted_engine import ScriptedEngine


@pytest.fixture
async def engine() -> AsyncIterator[ScriptedEngine]:
    async with ScriptedEngine() as serving:
        yield serving


@pytest.fixture
def session() -> WireEngineSession:
    return WireEngineSession()


async def until(check: Callable[[], bool], what: str, within: float = 5.0) -> None:
    with anyio.fail_after(within):
        while not check():
            await anyio.sleep(0.005)


def nobody_listens() -> str:
    return f"http://127.0.0.1:{free_port()}"


async def test_status_and_body_on_one_kept_alive_connection(engine: ScriptedEngine, session: WireEngineSession) -> None:
    engine.add("/health?full=1", 200, b"ok")
    engine.add("/missing", 404, b'{"detail":"Not Found"}')
    engine.add("/sleep", 200, b"{}")
    engine.add("/metrics", 200, b"a 1\nb 2\n" * 50, content_type="text/plain", how="chunked")
    assert await session.request("GET", engine.url + "/health?full=1") == (200, b"ok")
    assert await session.request("GET", engine.url + "/missing") == (404, b'{"detail":"Not Found"}')  # not raised
    assert await session.request("POST", engine.url + "/sleep", b'{"level":1}') == (200, b"{}")
    assert await session.request("GET", engine.url + "/metrics") == (200, b"a 1\nb 2\n" * 50)
    assert engine.connections == 1  # each answer complete: the one connection went back to the pool every time
    get, post = engine.requests[0], engine.requests[2]
    assert (get.method, get.target, get.body) == ("GET", "/health?full=1", b"")
    assert get.headers["host"] == engine.url.removeprefix("http://") and get.headers["accept"] == "*/*"
    assert get.headers["content-length"] == "0" and "content-type" not in get.headers
    assert (post.method, post.target, post.body) == ("POST", "/sleep", b'{"level":1}')
    assert post.headers["content-type"] == "application/json" and post.headers["content-length"] == "11"


async def test_side_requests_share_the_pool_with_decisions(engine: ScriptedEngine, session: WireEngineSession) -> None:
    engine.add("/v1/systemone", 200, b'{"answer":1}')
    engine.add("/metrics", 200, b"x 1\n")
    assert await session.decide(EngineAddress(engine.url), b"{}") == b'{"answer":1}'
    assert await session.request("GET", engine.url + "/metrics") == (200, b"x 1\n")
    assert engine.connections == 1


async def test_a_timeout_closes_the_connection_and_never_pools_it(
    engine: ScriptedEngine, session: WireEngineSession
) -> None:
    engine.add("/sleep", how="stall")
    engine.add("/health", 200, b"ok")
    began = time.monotonic()
    with pytest.raises(EngineUnavailable, match=r"did not answer POST /sleep within 0.2 s"):
        await session.request("POST", engine.url + "/sleep", timeout=0.2)
    assert time.monotonic() - began < 2
    await until(lambda: engine.hung_up == 1, "the engine to see its connection closed")
    assert await session.request("GET", engine.url + "/health") == (200, b"ok")
    assert engine.connections == 2  # the cut connection was not reused
    engine.add("/metrics", 200, b"a 1\nb 2\n", how="hang")  # the head and half the body, then silence
    with pytest.raises(EngineUnavailable, match=r"did not answer GET /metrics within 0.2 s"):
        await session.request("GET", engine.url + "/metrics", timeout=0.2)
    await until(lambda: engine.hung_up == 2, "the engine to see its connection closed")


async def test_a_cancelled_request_closes_its_connection(engine: ScriptedEngine, session: WireEngineSession) -> None:
    engine.add("/wake_up", how="stall")
    engine.add("/health", 200, b"ok")
    with anyio.move_on_after(0.2) as scope:  # the caller's own deadline, no timeout of the request's
        await session.request("POST", engine.url + "/wake_up", timeout=None)
    assert scope.cancelled_caught
    await until(lambda: engine.hung_up == 1, "the engine to see its connection closed")
    assert await session.request("GET", engine.url + "/health") == (200, b"ok")
    assert engine.connections == 2


async def test_an_answer_past_the_limit_is_refused_and_its_connection_closed(
    engine: ScriptedEngine, session: WireEngineSession
) -> None:
    engine.add("/metrics", 200, b"m" * 1000)
    engine.add("/metrics", 200, b"m" * 1001, how="chunked")
    engine.add("/metrics", 200, b"m" * (_MAX_ANSWER + 1))
    engine.add("/metrics", 200, b"fine")
    assert await session.request("GET", engine.url + "/metrics", limit=1000) == (200, b"m" * 1000)
    with pytest.raises(EdgeError, match="larger than 1000 bytes"):
        await session.request("GET", engine.url + "/metrics", limit=1000)
    await until(lambda: engine.hung_up == 1, "the engine to see its connection closed")
    assert await fetch_ok(session, engine.url + "/metrics") is None  # past the default limit: no reading
    await until(lambda: engine.hung_up == 2, "the engine to see its connection closed")
    assert await fetch_ok(session, engine.url + "/metrics") == b"fine"
    assert engine.connections == 3


async def test_an_engine_that_breaks_mid_answer(engine: ScriptedEngine, session: WireEngineSession) -> None:
    engine.add("/metrics", 200, b"a 1\nb 2\n", how="cut")
    engine.add("/metrics", how="close")  # (on a fresh connection: the last one was closed by the engine)
    engine.add("/sleep?level=1&mode=wait", 200, b'{"ok":true}', how="cut")
    engine.add("/health", 200, b'{"status":"ok"}')
    with pytest.raises(EngineUnavailable, match="broke before its answer ended"):
        await session.request("GET", engine.url + "/metrics")
    assert await fetch_ok(session, engine.url + "/metrics") is None  # closed without a word
    with pytest.raises(EngineUnavailable, match=r"/sleep\?level=1&mode=wait: the engine connection broke"):
        await post_ok(session, engine.url + "/sleep?level=1&mode=wait")
    assert await fetch_json(session, engine.url + "/health") == {"status": "ok"}  # and it is answered again


async def test_an_engine_that_is_not_there(session: WireEngineSession) -> None:
    down = nobody_listens()
    with pytest.raises(EngineUnavailable, match="could not reach the engine"):
        await session.request("GET", down + "/health")
    assert await fetch_ok(session, down + "/health") is None
    assert await fetch_json(session, down + "/version") is None
    with pytest.raises(EngineUnavailable, match=rf"^{down}/flush_cache: could not reach the engine"):
        await post_ok(session, down + "/flush_cache")


async def test_post_ok_sends_json_and_reads_refusals(engine: ScriptedEngine, session: WireEngineSession) -> None:
    engine.add("/collective_rpc", 200, b"null")
    engine.add("/flush_cache", 200)
    engine.add("/release_memory_occupation", 400, json={"error": {"message": "busy", "type": "BadRequestError"}})
    await post_ok(session, engine.url + "/collective_rpc", {"method": "reload_weights"})
    await post_ok(session, engine.url + "/flush_cache")
    with pytest.raises(EngineError, match="busy") as refused:
        await post_ok(session, engine.url + "/release_memory_occupation", {})
    assert refused.value.status == 400
    assert engine.sent() == [
        ("POST", "/collective_rpc", b'{"method":"reload_weights"}'),
        ("POST", "/flush_cache", b""),
        ("POST", "/release_memory_occupation", b"{}"),
    ]
    assert engine.connections == 1  # a refusal is a whole answer: its connection is kept too


async def test_fetch_helpers_read_only_a_200(engine: ScriptedEngine, session: WireEngineSession) -> None:
    engine.add("/version", 200, json={"version": "1"})
    engine.add("/version", 503, json={"version": "1"})
    engine.add("/version", 200, b"[1, 2]")
    engine.add("/version", 200, b"<html>")
    engine.add("/health", 204)
    assert await fetch_json(session, engine.url + "/version") == {"version": "1"}
    assert await fetch_json(session, engine.url + "/version") is None
    assert await fetch_json(session, engine.url + "/version") is None  # JSON, but not an object
    assert await fetch_json(session, engine.url + "/version") is None
    assert await fetch_ok(session, engine.url + "/health") is None
