"""Settlement rules (CAN-2), pure, and the instance's settlement driven by a fake engine's load readings."""

from __future__ import annotations

import anyio
import pytest

from capyctl.domain.ports import EngineLoad
from capyctl.domain.requests import RequestRecord
from capyctl.domain.settlement import ENGINE_IDLE, ENGINE_STOP, Ledger
from capyctl.services.events import Events
from capyctl.services.settling import Settlement
from tests.fakes.ports import FakeEngineAdapter, FakeStore, VirtualClock, virtual_time

anyio_backend = pytest.fixture(virtual_time)  # the polling runs on virtual time


def test_an_answered_cut_settles_at_the_first_idle_reading_taken_after_it() -> None:
    ledger = Ledger()
    ledger.cut("a", answered=True, at=10.0)
    assert ledger.reading(0, 0, taken_at=9.5) == []  # started before the cut: proves nothing
    assert ledger.reading(1, 0, taken_at=10.5) == []  # still running
    assert ledger.reading(0, 2, taken_at=10.6) == []  # still waiting
    settled = ledger.reading(0, 0, taken_at=11.0)
    assert [(s.request, s.rule, s.seconds) for s in settled] == [("a", ENGINE_IDLE, 1.0)]
    assert ledger.counts() == []


def test_an_unanswered_cut_waits_for_the_engine_to_end() -> None:
    ledger = Ledger()
    ledger.cut("b", answered=False, at=5.0)
    ledger.cut("c", answered=True, at=6.0)
    assert [s.request for s in ledger.reading(0, 0, taken_at=7.0)] == ["c"]  # the idle report settles only c
    assert ledger.counts() == [{"rule": ENGINE_STOP, "count": 1}]
    assert [(s.request, s.rule) for s in ledger.engine_ended(at=20.0)] == [("b", ENGINE_STOP)]
    assert ledger.counts() == []


def test_counts_per_rule() -> None:
    ledger = Ledger()
    for n in range(3):
        ledger.cut(f"i{n}", answered=True, at=1.0)
    ledger.cut("s", answered=False, at=1.0)
    assert ledger.counts() == [{"rule": ENGINE_IDLE, "count": 3}, {"rule": ENGINE_STOP, "count": 1}]


class LoadEngine(FakeEngineAdapter):
    """An engine whose load readings the test sets; each reading is recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.now = EngineLoad(1, 0)
        self.readings = 0

    async def load(self, base_url: str) -> EngineLoad | None:
        self.readings += 1
        return self.now


async def test_the_instance_reads_the_engine_until_idle_then_stops_reading() -> None:
    store, engine = FakeStore(), LoadEngine()
    settlement = Settlement(
        "m", 2, lambda: engine.load("http://e"), VirtualClock(), Events(store, VirtualClock()), poll=0.005
    )
    async with anyio.create_task_group() as tg:
        settlement.bind(tg)
        settlement.cut(RequestRecord(id="01REQUESTID", deployment="m", stream=True, answered=True))
        with anyio.fail_after(5):
            while engine.readings < 3:  # it keeps reading while the engine reports work
                await anyio.sleep(0.005)
        assert settlement.ledger.counts() == [{"rule": ENGINE_IDLE, "count": 1}]
        engine.now = EngineLoad(0, 0)
        with anyio.fail_after(5):
            while settlement.ledger.counts():
                await anyio.sleep(0.005)
    readings = engine.readings
    assert store.kinds()[-2:] == ["request_cut", "request_settled"]
    settled = [e for e in store.events if e["kind"] == "request_settled"][0]["detail"]
    assert settled["rule"] == ENGINE_IDLE and "01REQUESTID" not in str(settled)  # no request IDs in events
    cut = [e for e in store.events if e["kind"] == "request_cut"][0]["detail"]
    assert cut["instance"] == settled["instance"] == 2  # the instance whose cut requests they are
    assert engine.readings == readings  # nothing left to settle: no more readings


async def test_an_unanswered_cut_is_settled_only_by_the_engine_ending() -> None:
    store, engine = FakeStore(), LoadEngine()
    engine.now = EngineLoad(0, 0)
    settlement = Settlement(
        "m", 2, lambda: engine.load("http://e"), VirtualClock(), Events(store, VirtualClock()), poll=0.005
    )
    async with anyio.create_task_group() as tg:
        settlement.bind(tg)
        settlement.cut(RequestRecord(id="r", deployment="m", stream=False, answered=False))
        await anyio.sleep(0.05)
    assert engine.readings == 0 and settlement.ledger.counts() == [{"rule": ENGINE_STOP, "count": 1}]
    settlement.engine_ended()
    assert settlement.ledger.counts() == [] and store.kinds()[-1] == "request_settled"
