"""Whatever goes wrong inside CapyCTL, the client gets an answer: the envelope, a request ID, the log has the rest."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import anyio
import msgspec
import pytest

from capyctl.adapters.http.asgi import with_request_ids
from capyctl.adapters.http.chat import ChatEndpoint
from capyctl.adapters.http.front import FrontDoor
from capyctl.domain.deployments import Deployment, Desired, InstanceState
from capyctl.domain.engines import EngineFamily, EngineInstall
from capyctl.domain.errors import EdgeError, EngineUnavailable
from capyctl.domain.fields import row_for
from capyctl.domain.lifecycle import EngineAddress
from capyctl.domain.request_rows import RowFilter
from capyctl.domain.streams import DONE, Chunks, Relayed, sse_of
from capyctl.services.chat import ChatService
from capyctl.services.controllers import AttachedController
from capyctl.services.events import Events
from capyctl.services.fleet import decode_spec
from capyctl.services.request_log import RequestLog
from capyctl.services.requests import Call, RequestSettings
from tests.fakes.answers import ScriptedAnswer
from tests.fakes.asgi_door import AsgiDoor
from tests.fakes.ports import FakeClock, FakeEngineAdapter, FakeStore, keyring_with
from tests.fakes.request_store import FakeRequestStore

KEY = "k" * 32


class BrokenService:
    """A ChatService whose engine call breaks with a bug (not a CapyError) after ``after`` batches."""

    check_every = 1.0
    default_model = None

    def __init__(self, after: int | None) -> None:
        self._after = after

    def now(self) -> float:
        return 0.0

    def overdue(self, call: Call) -> bool:
        return False

    def knows(self, name: str) -> bool:
        return True

    def names(self) -> list[str]:
        return ["m"]

    def start(self, call: Call) -> None:
        return None  # nothing done before the request's task runs

    async def complete(self, call: Call) -> dict[str, Any]:
        raise RuntimeError("a bug in the assembler")

    @asynccontextmanager
    async def open(self, call: Call) -> AsyncIterator[Call]:
        class Check:  # relays what it is given
            failure = None

            def check(self, chunks: Chunks) -> bytes:
                return chunks.sse

        class Answer:
            async def pump(self, deliver: Any, drain: Any) -> bool:
                if deliver([Chunks(b'data: {"choices":[]}\n\n', [b'{"choices":[]}'])]) is Relayed.FULL:
                    await drain()
                raise RuntimeError("a bug in the relay")

        call.check, call.meter, call.answer = Check(), SimpleNamespace(first_text_at=None), Answer()  # type: ignore[assignment]  # fakes of the check and meter
        yield call


class Stats:
    def answered(self, *args: Any) -> None: ...
    def relayed_first_chunk(self, *args: Any) -> None: ...
    def refused(self, *args: Any) -> None: ...


async def call(app: Any, scope: dict[str, Any], body: bytes = b"") -> list[dict[str, Any]]:
    sent: list[dict[str, Any]] = []
    gone = anyio.Event()
    messages = [{"type": "http.request", "body": body, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if messages:
            return messages.pop()
        await gone.wait()  # the client never hangs up
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    with anyio.fail_after(5):
        await app(scope, receive, send)
    return sent


def chat_scope() -> dict[str, Any]:
    return {
        "type": "http",
        "method": "POST",
        "path": "/v1/chat/completions",
        "headers": [(b"authorization", f"Bearer {KEY}".encode())],
    }


def header(start: dict[str, Any], name: bytes) -> str:
    return dict(start["headers"])[name].decode()


async def test_a_bug_in_a_non_streamed_answer_is_internal_error_with_the_id(caplog: pytest.LogCaptureFixture) -> None:
    records = RequestLog(FakeRequestStore(), FakeClock())
    handler = AsgiDoor(
        FrontDoor(
            [ChatEndpoint(BrokenService(None), Stats())],
            keyring_with(KEY),
            1 << 20,
            Stats(),  # type: ignore[arg-type]
            records,
        )
    )
    with caplog.at_level(logging.ERROR, "capyctl.http"):
        sent = await call(handler, chat_scope(), b'{"model": "m", "messages": []}')
    start, body = sent[0], msgspec.json.decode(sent[1]["body"])
    request_id = header(start, b"x-capyctl-request-id")
    assert start["status"] == 500 and len(request_id) == 26
    assert body["error"]["code"] == "internal_error" and body["error"]["request_id"] == request_id
    assert request_id in body["error"]["message"]
    logged = [r for r in caplog.records if request_id in r.getMessage()]
    assert logged and logged[0].exc_info
    assert "a bug in the assembler" in logging.Formatter().formatException(logged[0].exc_info)  # the traceback
    (row,) = await records.find(RowFilter())  # the request records keep it too
    assert (row.id, row.code, row.status, row.deployment, row.key) == (
        request_id,
        "internal_error",
        500,
        "m",
        "default",
    )


async def test_a_bug_during_a_stream_ends_it_with_an_error_event() -> None:
    records = RequestLog(FakeRequestStore(), FakeClock())
    handler = AsgiDoor(
        FrontDoor(
            [ChatEndpoint(BrokenService(1), Stats())],
            keyring_with(KEY),
            1 << 20,
            Stats(),  # type: ignore[arg-type]
            records,
        )
    )
    sent = await call(handler, chat_scope(), b'{"model": "m", "messages": [], "stream": true}')
    assert sent[0]["status"] == 200
    assert sent[1]["body"] == b'data: {"choices":[]}\n\n'  # what came before the bug was relayed
    last = sent[-1]
    assert last["more_body"] is False and last["body"].startswith(b"data: ")
    assert msgspec.json.decode(last["body"][6:])["error"]["code"] == "internal_error"
    (row,) = await records.find(RowFilter())
    assert (row.code, row.status, row.stream) == ("internal_error", 200, True)  # its stream had begun: 200 sent


async def test_other_routes_get_an_id_and_a_last_resort() -> None:
    async def broken(scope: Any, receive: Any, send: Any) -> None:
        raise KeyError("oops")

    async def fine(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    scope = {"type": "http", "method": "GET", "path": "/engines", "headers": []}
    sent = await call(with_request_ids(broken), dict(scope))
    assert sent[0]["status"] == 500
    error = msgspec.json.decode(sent[1]["body"])["error"]
    assert error["code"] == "internal_error" and error["request_id"] == header(sent[0], b"x-capyctl-request-id")
    sent = await call(with_request_ids(fine), dict(scope))
    assert sent[0]["status"] == 200 and len(header(sent[0], b"x-capyctl-request-id")) == 26


async def test_a_broken_connection_to_an_attached_engine_is_answered_at_once() -> None:
    """An attached engine is not CapyCTL's to watch: no wait for it to 'exit' (it used to cost crash_notice)."""
    spec = decode_spec({"name": "m", "engine": "vllm", "endpoint": "http://127.0.0.1:9", "engine_version": "0.32.0"})
    engine = EngineInstall(name="vllm@x", family=EngineFamily.VLLM, path="x", version="0.32.0", version_text="")
    controller = AttachedController(
        Deployment(spec=spec),
        engine,
        FakeEngineAdapter(),
        FakeClock(),
        Events(FakeStore(), FakeClock()),
        row_for(engine.family, engine.version),
    )
    controller.want(Desired.RUN)
    assert await controller.route(1) == (EngineAddress("http://127.0.0.1:9"), 1)

    class Session:
        @asynccontextmanager
        async def chat_stream(self, base_url: str, body: bytes):
            raise EngineUnavailable("could not reach the engine")
            yield

    fleet = SimpleNamespace(instances=lambda name, api="chat": [controller])
    events = SimpleNamespace(selection=lambda *args: None)
    settings = RequestSettings(crash_notice=3600.0)  # were it waited for, the bound below would fail the test
    service = ChatService(fleet, Session(), FakeClock(), events, settings)  # type: ignore[arg-type]
    call = Call(id="r", deployment="m", stream=False, obj={"model": "m", "messages": []})
    with anyio.fail_after(5), pytest.raises(EngineUnavailable):
        await service.complete(call)
    assert controller.status.state is InstanceState.UNAVAILABLE  # the next request checks it again


async def test_a_chunk_relayed_unread_that_cannot_be_assembled_is_an_edge_error() -> None:
    """The check relays a field it does not read as sent (a number past float range, say); the non-streamed
    answer, which decodes every chunk whole, must end in edge_error, not in a bug's 500."""
    spec = decode_spec({"name": "m", "engine": "vllm", "endpoint": "http://127.0.0.1:9", "engine_version": "0.32.0"})
    engine = EngineInstall(name="vllm@x", family=EngineFamily.VLLM, path="x", version="0.32.0", version_text="")
    controller = AttachedController(
        Deployment(spec=spec),
        engine,
        FakeEngineAdapter(),
        FakeClock(),
        Events(FakeStore(), FakeClock()),
        row_for(engine.family, engine.version),
    )
    controller.want(Desired.RUN)
    payload = b'{"model":"m","created":1e999,"choices":[{"index":0,"delta":{"content":"hi"}}]}'

    class Session:
        @asynccontextmanager
        async def chat_stream(self, base_url: str, body: bytes):
            async def batches():
                yield [Chunks(sse_of([payload]), [payload]), DONE]

            yield ScriptedAnswer(batches())

    fleet = SimpleNamespace(instances=lambda name, api="chat": [controller])
    events = SimpleNamespace(selection=lambda *args: None)
    service = ChatService(fleet, Session(), FakeClock(), events, RequestSettings())  # type: ignore[arg-type]
    call = Call(id="r", deployment="m", stream=False, obj={"model": "m", "messages": []})
    with anyio.fail_after(5), pytest.raises(EdgeError, match="cannot assemble"):
        await service.complete(call)
