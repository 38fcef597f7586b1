"""The front door's rows, through the real chat handler, service and admission, in virtual time: a request
that waited in line and was cut by the deadline, and one whose client left while its answer ran."""

from __future__ import annotations

import anyio
import pytest

from capyctl.adapters.http.chat import ChatEndpoint
from capyctl.adapters.http.front import FrontDoor
from capyctl.domain.request_rows import RowFilter
from capyctl.domain.scheduling import QueueLimits
from capyctl.services.admission import AdmissionService
from capyctl.services.chat import ChatService
from capyctl.services.request_log import RequestLog
from capyctl.services.requests import RequestSettings
from tests.fakes.asgi_door import AsgiDoor
from tests.fakes.ports import VirtualClock, keyring_with, virtual_time
from tests.fakes.request_store import FakeRequestStore
from tests.unit.test_waiting import KEY, Client, SilentAfterOneChunk, Stats, one_attached_vllm

pytestmark = pytest.mark.anyio
anyio_backend = pytest.fixture(virtual_time)


async def test_a_waiter_cut_at_its_deadline_and_a_holder_whose_client_left_are_recorded() -> None:
    clock = VirtualClock()
    events, fleet = one_attached_vllm(clock)
    settings = RequestSettings(request_deadline=30.0, stream_idle_timeout=120.0)
    admission = AdmissionService(QueueLimits(max_in_flight_per_instance=1), clock, settings.request_deadline)
    service = ChatService(fleet, SilentAfterOneChunk(), clock, events, settings, admission)  # type: ignore[arg-type]
    records = RequestLog(FakeRequestStore(), clock)
    door = FrontDoor([ChatEndpoint(service, Stats())], keyring_with(KEY), 1 << 20, Stats(), records)  # type: ignore[arg-type]
    handler = AsgiDoor(door)

    holder = Client({"model": "m", "messages": [], "stream": True})
    waiter = Client({"model": "m", "messages": []})
    async with anyio.create_task_group() as tg:
        tg.start_soon(holder.run, handler)
        with anyio.fail_after(5):
            while holder.status() is None:
                await anyio.sleep(0.01)
        tg.start_soon(waiter.run, handler)
        with anyio.fail_after(60):
            while waiter.done_at is None:
                await anyio.sleep(0.1)
        holder.leave.set()
    (cut_waiter,) = await records.find(RowFilter(code="deadline_exceeded"))
    assert (cut_waiter.status, cut_waiter.instance, cut_waiter.cause, cut_waiter.settlement) == (
        504,
        None,
        "deadline",
        None,
    )  # no engine had it: nothing to settle
    assert cut_waiter.queue_wait_ms is not None and 29_900 <= cut_waiter.queue_wait_ms <= 31_500
    assert cut_waiter.key is not None and cut_waiter.deployment == "m" and cut_waiter.stream is False
    (left,) = await records.find(RowFilter(code="client_gone"))
    assert (left.status, left.instance, left.stream, left.cause, left.settlement, left.queue_wait_ms) == (
        200,
        0,
        True,
        "client_gone",
        "engine_idle",
        0.0,
    )  # its answer had begun: the engine's idle report settles it
    assert left.total_ms is not None and left.total_ms >= 30_000 and left.at == pytest.approx(clock.wall(), abs=1)
