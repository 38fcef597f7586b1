"""The request log service on fakes: rows appended off the request's path, written by its task in batches,
dropped and counted (never waited for) when the store is slow, lost and said when it fails."""

from __future__ import annotations

import logging
import threading
import time

import anyio
import pytest

from capyctl.domain.errors import InvalidRequest
from capyctl.domain.request_rows import RecordSettings, RequestRow, Retention, RowFilter
from capyctl.services.events import Events
from capyctl.services.request_log import RequestLog
from tests.fakes.ports import FakeClock, FakeStore
from tests.fakes.request_store import FakeRequestStore


def row(n: int, at: float = 1_000_000.0, **fields: object) -> RequestRow:
    return RequestRow(id=f"R{n:04d}", at=at, api="chat", code="ok", deployment="m", **fields)  # type: ignore[arg-type]


async def until(check: object, within: float = 10.0) -> None:
    with anyio.fail_after(within):
        while not check():  # type: ignore[operator]
            await anyio.sleep(0.005)


async def test_a_read_sees_the_rows_added_before_it_and_the_write_is_on_a_worker_thread() -> None:
    store = FakeRequestStore()
    records = RequestLog(store, FakeClock())
    for n in range(3):
        records.add(row(n))
    assert store.writes == []  # add only buffered them
    assert [r.id for r in await records.find(RowFilter())] == ["R0002", "R0001", "R0000"]
    assert store.write_threads and all(name != threading.current_thread().name for name in store.write_threads)
    assert (await records.get("R0001")) == row(1) and await records.get("nope") is None


async def test_the_task_writes_in_batches_by_itself_and_what_is_left_on_the_way_out() -> None:
    store = FakeRequestStore()
    records = RequestLog(store, FakeClock(), RecordSettings(flush_every=0.01, batch=2))
    async with anyio.create_task_group() as tg:
        await tg.start(records.run)
        for n in range(5):
            records.add(row(n))
        await until(lambda: len(store.rows) == 5)  # no read asked for it
        assert [len(batch) for batch in store.writes] == [2, 2, 1]
        store.gate.clear()  # the next write waits: what is added now is still buffered at the cancel
        records.add(row(5))
        await until(store.entered.is_set)
        records.add(row(6))
        store.gate.set()
        tg.cancel_scope.cancel()
    assert [r.id for r in store.rows][-2:] == ["R0005", "R0006"]


async def test_a_slow_store_never_makes_add_wait_past_the_bound_rows_are_dropped_counted_and_said(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = FakeRequestStore()
    records = RequestLog(store, FakeClock(), RecordSettings(buffer=10, flush_every=0.01))
    store.gate.clear()  # the disk hangs
    async with anyio.create_task_group() as tg:
        await tg.start(records.run)
        records.add(row(0))
        await until(store.entered.is_set)  # the task is stuck in its write, on its thread
        began = time.perf_counter()
        for n in range(1, 26):
            records.add(row(n))
        assert time.perf_counter() - began < 0.5  # 25 adds while the store hangs: none of them waited on it
        assert records.dropped == 15  # 10 buffered, the rest dropped
        with caplog.at_level(logging.WARNING, logger="capyctl.records"):
            store.gate.set()
            await until(lambda: "dropped 15 request records" in caplog.text)
        await until(lambda: len(store.rows) == 11)
        tg.cancel_scope.cancel()
    assert [r.id for r in store.rows] == [f"R{n:04d}" for n in range(11)]


async def test_a_failing_store_loses_that_batch_says_so_and_the_next_batch_is_written(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store = FakeRequestStore()
    records = RequestLog(store, FakeClock())
    store.fail = True
    records.add(row(1))
    with caplog.at_level(logging.ERROR, logger="capyctl.records"):
        assert await records.find(RowFilter()) == []  # the read is answered even so
    assert records.lost == 1 and "could not store 1 request records" in caplog.text
    store.fail = False
    records.add(row(2))
    assert [r.id for r in await records.find(RowFilter())] == ["R0002"]


async def test_a_settled_cut_updates_its_row_through_the_events() -> None:
    store = FakeRequestStore()
    events = Events(FakeStore(), FakeClock())
    records = RequestLog(store, FakeClock())
    events.on_settled(records.settle)
    records.add(row(1, cause="client_gone", settlement="engine_idle"))
    events.settled("R0001", "engine_idle", 0.25)
    (found,) = await records.find(RowFilter())
    assert found.settlement == "engine_idle" and found.settled_s == 0.25


async def test_the_store_is_kept_within_the_retention_as_the_task_goes() -> None:
    store, clock = FakeRequestStore(), FakeClock()
    retention = Retention(max_count=2, max_age=60)
    records = RequestLog(store, clock, RecordSettings(retention=retention, prune_every=30))
    for n in range(4):
        records.add(row(n, at=clock.now))
    await records.flush()
    assert [r.id for r in store.rows] == ["R0002", "R0003"] and store.prunes == [(retention, clock.now)]
    clock.now += 10
    await records.flush()
    assert len(store.prunes) == 1  # not yet time
    clock.now += 100
    await records.flush()
    assert store.rows == [] and len(store.prunes) == 2  # both too old now


async def test_charts_read_the_window_of_rows_and_refuse_an_unknown_window() -> None:
    store, clock = FakeRequestStore(), FakeClock()
    records = RequestLog(store, clock)
    records.add(row(1, at=clock.now - 10, ttft_ms=120.0))
    records.add(row(2, at=clock.now - 7200, ttft_ms=999.0))  # outside the hour
    charts = await records.chart("1h")
    assert sum(b.requests for b in charts["m"]) == 1 and charts["m"][-1].ttft_p50_ms == 120.0
    with pytest.raises(InvalidRequest) as refused:
        await records.chart("2d")
    assert refused.value.extra["param"] == "window"


async def test_recent_figures_come_from_stored_rows_survive_a_restart_and_age_out() -> None:
    store, clock = FakeRequestStore(), FakeClock()
    records = RequestLog(store, clock, RecordSettings(flush_every=0.01))
    records.add(row(1, at=clock.now - 1, ttft_ms=100.0, decode_tokens_per_second=30.0))
    assert records.recent() == {}  # only buffered: not stored yet
    await records.flush()
    assert records.recent()["m"].ttft_p50_ms == 100.0
    records.add(row(2, at=clock.now, ttft_ms=300.0))
    records.add(row(3, at=clock.now, ttft_ms=200.0))
    await records.flush()
    figures = records.recent()["m"]
    assert (figures.requests, figures.ttft_p50_ms, figures.decode_tokens_per_second_p50) == (3, 200.0, 30.0)

    again = RequestLog(store, clock)  # a restarted server reads the last minutes back from the store
    async with anyio.create_task_group() as tg:
        await tg.start(again.run)
        assert again.recent()["m"].requests == 3
        tg.cancel_scope.cancel()
    clock.now += 299.5  # row 1 is now older than five minutes; rows 2 and 3 not yet
    assert again.recent()["m"].requests == 2
    clock.now += 1
    assert again.recent() == {}
