"""A request waiting in line for a slot, through the real chat handler, service and admission, in virtual time.

The engine is a fake session that answers one chunk and then keeps its
stream open, so the first request holds the only slot. Nothing here reads
real time: the request deadline passes on trio's mock clock.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import anyio
import msgspec
import pytest
import trio

from capyctl.adapters.http.chat import ChatEndpoint
from capyctl.adapters.http.front import FrontDoor
from capyctl.domain.deployments import Deployment, Desired
from capyctl.domain.engines import EngineFamily, EngineInstall
from capyctl.domain.fields import row_for
from capyctl.domain.scheduling import QueueLimits
from capyctl.services.admission import AdmissionService
from capyctl.services.chat import ChatService
from capyctl.services.controllers import AttachedController
from capyctl.services.events import Events
from capyctl.services.fleet import decode_spec
from capyctl.services.requests import RequestSettings
from tests.fakes.answers import ScriptedAnswer, chunks
from tests.fakes.asgi_door import AsgiDoor
from tests.fakes.ports import FakeEngineAdapter, FakeStore, VirtualClock, keyring_with, virtual_time

pytestmark = pytest.mark.anyio
anyio_backend = pytest.fixture(virtual_time)
KEY = "k" * 32
CHUNK = {
    "id": "c",
    "object": "chat.completion.chunk",
    "created": 1,
    "model": "m",
    "choices": [{"index": 0, "delta": {"role": "assistant", "content": "hi"}, "finish_reason": None}],
}


class SilentAfterOneChunk:
    """An engine that answers one chunk, then stays silent with the stream open."""

    def __init__(self) -> None:
        self.open = 0

    @asynccontextmanager
    async def chat_stream(self, base_url: str, body: bytes) -> AsyncIterator[ScriptedAnswer]:
        async def events() -> AsyncIterator[list[Any]]:
            yield [chunks(CHUNK)]
            await anyio.sleep_forever()

        self.open += 1
        try:
            yield ScriptedAnswer(events())
        finally:
            self.open -= 1


class Stats:
    def answered(self, *args: Any) -> None: ...
    def relayed_first_chunk(self, *args: Any) -> None: ...
    def refused(self, *args: Any) -> None: ...


class Client:
    """One HTTP exchange with the handler; hangs up when ``leave`` is set."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = msgspec.json.encode(body)
        self.sent: list[dict[str, Any]] = []
        self.leave = anyio.Event()
        self.done_at: float | None = None

    async def run(self, app: Any) -> None:
        messages = [{"type": "http.request", "body": self.body, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop()
            await self.leave.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            self.sent.append(message)

        scope = {
            "type": "http",
            "method": "POST",
            "path": "/v1/chat/completions",
            "headers": [(b"authorization", f"Bearer {KEY}".encode())],
        }
        await app(scope, receive, send)
        self.done_at = trio.current_time()

    def status(self) -> int | None:
        return self.sent[0]["status"] if self.sent else None


def one_attached_vllm(clock: VirtualClock) -> tuple[Events, Any]:
    """The events and a fleet of one attached vLLM 0.32.0 deployment ``m``, wanted running."""
    spec = decode_spec({"name": "m", "engine": "vllm", "endpoint": "http://127.0.0.1:9", "engine_version": "0.32.0"})
    engine = EngineInstall(name="vllm@x", family=EngineFamily.VLLM, path="x", version="0.32.0", version_text="")
    events = Events(FakeStore(), clock)
    controller = AttachedController(
        Deployment(spec=spec), engine, FakeEngineAdapter(), clock, events, row_for(engine.family, engine.version)
    )
    controller.want(Desired.RUN)
    fleet = SimpleNamespace(
        instances=lambda name, api="chat": [controller],
        has=lambda name: True,
        get=lambda name: controller,
        names=lambda: ["m"],
    )
    return events, fleet


async def test_the_request_deadline_cuts_a_waiter_and_frees_only_its_place() -> None:
    clock = VirtualClock()
    events, fleet = one_attached_vllm(clock)
    settings = RequestSettings(request_deadline=30.0, stream_idle_timeout=120.0)
    admission = AdmissionService(QueueLimits(max_in_flight_per_instance=1), clock, settings.request_deadline)
    engine_session = SilentAfterOneChunk()
    service = ChatService(fleet, engine_session, clock, events, settings, admission)  # type: ignore[arg-type]
    handler = AsgiDoor(FrontDoor([ChatEndpoint(service, Stats())], keyring_with(KEY), 1 << 20, Stats()))  # type: ignore[arg-type]

    holder = Client({"model": "m", "messages": [], "stream": True})
    waiter = Client({"model": "m", "messages": []})
    async with anyio.create_task_group() as tg:
        tg.start_soon(holder.run, handler)
        with anyio.fail_after(5):
            while holder.status() is None:  # it holds the one slot, its answer begun and then silent
                await anyio.sleep(0.01)
        tg.start_soon(waiter.run, handler)
        with anyio.fail_after(5):
            while admission.state.waiting("m") != 1:
                await anyio.sleep(0.01)
        arrived = trio.current_time()
        with anyio.fail_after(60):
            while waiter.done_at is None:
                await anyio.sleep(0.1)
        assert waiter.status() == 504
        assert msgspec.json.decode(waiter.sent[1]["body"])["error"]["code"] == "deadline_exceeded"
        waited = waiter.done_at - arrived
        assert 30.0 - 0.1 <= waited <= 30.0 + service.check_every + 0.1  # cut at its deadline, not before
        # its place in line is freed, and only its own: the holder still has its slot and its engine call
        assert (admission.state.waiting("m"), admission.state.in_flight("m")) == (0, 1)
        assert holder.done_at is None and engine_session.open == 1
        holder.leave.set()
    assert (admission.state.waiting("m"), admission.state.in_flight("m")) == (0, 0) and engine_session.open == 0
