"""Failover before acceptance, through the real chat and decision services, in virtual time: a request that
reached no engine at one instance goes to another (with a ``router_failover`` event naming why); one that an
engine may have seen never does; at most every instance is tried once."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from capyctl.domain.balancing import Unsent
from capyctl.domain.deployments import Deployment, Desired
from capyctl.domain.engines import EngineFamily, EngineInstall
from capyctl.domain.errors import DeviceOffline, EngineUnavailable
from capyctl.domain.fields import row_for
from capyctl.domain.lifecycle import EngineAddress
from capyctl.domain.streams import DONE
from capyctl.services.chat import ChatService
from capyctl.services.controllers import AttachedController
from capyctl.services.events import Events
from capyctl.services.fleet import decode_spec
from capyctl.services.requests import Call, RequestSettings
from tests.fakes.answers import ScriptedAnswer, chunks
from tests.fakes.ports import FakeEngineAdapter, FakeStore, VirtualClock, virtual_time

pytestmark = pytest.mark.anyio
anyio_backend = pytest.fixture(virtual_time)
CHUNK = {
    "id": "c",
    "object": "chat.completion.chunk",
    "created": 1,
    "model": "m",
    "choices": [{"index": 0, "delta": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
}


class Engines:
    """Instance ``i``'s engine at ``http://127.0.0.1:900<i>``: each listed in ``refuse`` fails the way given
    before anything is written; the others answer one chunk."""

    def __init__(self, refuse: dict[int, EngineUnavailable]) -> None:
        self.refuse = refuse
        self.reached: list[int] = []

    @asynccontextmanager
    async def chat_stream(self, address: EngineAddress, body: bytes) -> AsyncIterator[ScriptedAnswer]:
        index = int(address.url[-1])
        if index in self.refuse:
            raise self.refuse[index]
        self.reached.append(index)

        async def events() -> AsyncIterator[list[Any]]:
            yield [chunks(CHUNK), DONE]

        yield ScriptedAnswer(events())


def fleet_of(urls: list[str], events: Events, clock: Any) -> Any:
    """Deployment ``m`` with an attached instance at each of ``urls`` (its own engine), all counted ready (also
    used by ``bench/failover.py``)."""
    engine = EngineInstall(name="vllm@x", family=EngineFamily.VLLM, path="x", version="0.32.0", version_text="")
    members = []
    for index, url in enumerate(urls):
        spec = decode_spec({"name": "m", "engine": "vllm", "endpoint": url, "engine_version": "0.32.0"})
        member = AttachedController(
            Deployment(spec=spec), engine, FakeEngineAdapter(), clock, events, row_for("vllm", "0.32.0"), index
        )
        member.want(Desired.RUN)
        member.status.state = member.status.state.READY
        members.append(member)
    return SimpleNamespace(
        instances=lambda name, api="chat": members,
        has=lambda name: True,
        get=lambda name: SimpleNamespace(members=members),
        names=lambda: ["m"],
    )


async def ask(refuse: dict[int, EngineUnavailable], count: int = 3) -> tuple[Any, Engines, FakeStore, Call]:
    clock, store = VirtualClock(), FakeStore()
    events = Events(store, clock)
    engines = Engines(refuse)
    urls = [f"http://127.0.0.1:900{index}" for index in range(count)]
    service = ChatService(fleet_of(urls, events, clock), engines, clock, events, RequestSettings())  # type: ignore[arg-type]
    call = Call(id="r1", deployment="m", stream=False, obj={"model": "m", "messages": []})
    with anyio.fail_after(5):
        try:
            answer: Any = await service.complete(call)
        except EngineUnavailable as error:
            answer = error
    return answer, engines, store, call


def failovers(store: FakeStore) -> list[tuple[int, str]]:
    return [(e["detail"]["instance"], e["detail"]["reason"]) for e in store.events if e["kind"] == "router_failover"]


@pytest.mark.parametrize("cause", list(Unsent))
async def test_a_request_that_reached_no_engine_is_answered_by_another_instance(cause: Unsent) -> None:
    answer, engines, store, call = await ask({0: EngineUnavailable("refused").before_sending(cause)})
    assert answer["choices"][0]["message"]["content"] == "hi"
    assert call.instance in (1, 2) and engines.reached == [call.instance] and call.tried == [0]
    assert failovers(store) == [(0, str(cause))]
    selected = [e["detail"]["instance"] for e in store.events if e["kind"] == "router_selection"]
    assert selected == [0, call.instance]  # each try is its own selection


async def test_a_request_an_engine_may_have_seen_is_never_sent_again() -> None:
    answer, engines, store, _ = await ask({0: EngineUnavailable("the connection broke after the request")})
    assert isinstance(answer, EngineUnavailable) and engines.reached == []
    assert failovers(store) == []


async def test_every_instance_is_tried_once_at_most() -> None:
    refused = {i: EngineUnavailable("refused").before_sending(Unsent.REFUSED) for i in range(3)}
    answer, engines, store, call = await ask(refused)
    assert isinstance(answer, EngineUnavailable) and answer.unsent == Unsent.REFUSED
    assert len(failovers(store)) == 2 and {reason for _, reason in failovers(store)} == {"connection_refused"}
    assert sorted([*call.tried, call.instance]) == [0, 1, 2]  # each once, the last one's error answered


async def test_no_more_than_four_instances_are_tried() -> None:
    refused = {i: EngineUnavailable("refused").before_sending(Unsent.TLS) for i in range(6)}
    answer, _, store, call = await ask(refused, count=6)
    assert isinstance(answer, EngineUnavailable)
    tried = [i for i, _ in failovers(store)]
    assert len(tried) == 3 and tried == call.tried and len({*tried, call.instance}) == 4  # four, then the error


async def test_an_instance_whose_host_is_away_when_routed_hands_the_request_to_another() -> None:
    clock, store = VirtualClock(), FakeStore()
    events = Events(store, clock)
    fleet = fleet_of(["http://127.0.0.1:9000", "http://127.0.0.1:9001"], events, clock)
    away = fleet.instances("m")[0]

    async def route(timeout: float) -> Any:
        raise DeviceOffline("gpu-a", "suspended", model="m", retry_after=1)

    away.route = route
    for member in fleet.instances("m"):  # neither ready at once (the request waits for its grant) ...
        member.route_now = lambda: None
    fleet.instances("m")[1].in_flight = 1  # ... and the first, the less loaded, is asked first: its host is away
    engines = Engines({})
    service = ChatService(fleet, engines, clock, events, RequestSettings())  # type: ignore[arg-type]
    call = Call(id="r1", deployment="m", stream=False, obj={"model": "m", "messages": []})
    with anyio.fail_after(5):
        answer = await service.complete(call)
    assert answer["choices"][0]["message"]["content"] == "hi" and engines.reached == [1]
    assert failovers(store) == [(0, "host_away")] and call.tried == [0]
    assert fleet.instances("m")[1].in_flight == 1  # its count is back where it was: the request left


async def test_a_burst_of_requests_is_spread_as_they_arrive_each_counted_at_its_instance_when_written() -> None:
    """A burst's requests are each started (picked and written) as its last byte comes, before any is relayed:
    each must be counted at its instance then, or every later pick sees the same counts and takes the same
    instance."""
    clock, store = VirtualClock(), FakeStore()
    events = Events(store, clock)
    engines = Engines({})
    fleet = fleet_of([f"http://127.0.0.1:900{index}" for index in range(2)], events, clock)
    service = ChatService(fleet, engines, clock, events, RequestSettings())  # type: ignore[arg-type]
    calls = [Call(id=f"r{n}", deployment="m", stream=False, obj={"model": "m", "messages": []}) for n in range(12)]
    for call in calls:
        service.start(call)
    assert [call.controller.index for call in calls] == [0, 1] * 6  # type: ignore[union-attr]
    assert [m.in_flight for m in fleet.instances("m")] == [6, 6]
    with anyio.fail_after(5):
        for call in calls:
            answer = await service.complete(call)
            assert answer["choices"][0]["message"]["content"] == "hi"
    assert sorted(engines.reached) == [0] * 6 + [1] * 6
    assert [(m.in_flight, m.left) for m in fleet.instances("m")] == [(0, 6), (0, 6)]  # each counted once
    assert [e["detail"]["instance"] for e in store.events if e["kind"] == "router_selection"] == [0, 1] * 6


async def test_a_request_written_at_once_and_never_relayed_leaves_its_instance_when_it_closes() -> None:
    clock, store = VirtualClock(), FakeStore()
    events = Events(store, clock)
    abandoned: list[str] = []
    session = SimpleNamespace(
        chat_stream=lambda address, body: SimpleNamespace(abandon=lambda: abandoned.append(address.url))
    )
    fleet = fleet_of(["http://127.0.0.1:9000", "http://127.0.0.1:9001"], events, clock)
    service = ChatService(fleet, session, clock, events, RequestSettings())  # type: ignore[arg-type]
    call = Call(id="r1", deployment="m", stream=True, obj={"model": "m", "messages": []})
    service.start(call)  # picked and written at once
    assert [m.in_flight for m in fleet.instances("m")] == [1, 0]
    call.close()  # its client went away before the relay began
    assert abandoned == ["http://127.0.0.1:9000"]
    assert [(m.in_flight, m.left) for m in fleet.instances("m")] == [(0, 1), (0, 0)]
    call.close()  # once only
    assert [(m.in_flight, m.left) for m in fleet.instances("m")] == [(0, 1), (0, 0)]
