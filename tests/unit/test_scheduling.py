"""Admission rules (domain, pure) and the admission service on fakes: arrival order, limits, refusals, waits."""

from __future__ import annotations

import anyio
import pytest

from capyctl.domain.deployments import InstanceState
from capyctl.domain.errors import DeviceBusy, ModelLoading, Queued, QueueFull
from capyctl.domain.lifecycle import EngineAddress
from capyctl.domain.requests import RequestRecord
from capyctl.domain.scheduling import (
    GRANTED,
    QUEUED,
    Admission,
    Loading,
    QueueLimits,
    Refused,
    Route,
    loading_retry_after,
)
from capyctl.services.admission import AdmissionService
from tests.fakes.ports import VirtualClock, virtual_time

anyio_backend = pytest.fixture(virtual_time)  # the service's waits and timeouts run on virtual time

DEFAULT = QueueLimits()


def test_the_33rd_request_waits_and_is_granted_when_a_slot_frees_in_arrival_order() -> None:
    admission = Admission(DEFAULT)
    assert [admission.arrive("m", f"r{i}", ready=True) for i in range(32)] == [GRANTED] * 32
    assert [admission.arrive("m", f"w{i}", ready=True) for i in range(3)] == [QUEUED] * 3
    assert [admission.position("m", f"w{i}") for i in range(3)] == [1, 2, 3]
    admission.release("m", 1.0)
    assert admission.grants("m", ready=True) == ["w0"]  # the oldest waiter first
    assert admission.grants("m", ready=True) == []  # full again
    assert (admission.in_flight("m"), admission.waiting("m")) == (32, 2)


def test_a_later_request_does_not_overtake_waiters() -> None:
    admission = Admission(QueueLimits(max_in_flight_per_instance=1))
    assert admission.arrive("m", "a", ready=False) == QUEUED  # not ready: waits
    assert admission.arrive("m", "b", ready=True) == QUEUED  # a free slot, but someone waits first
    assert admission.grants("m", ready=True) == ["a"]


def test_pending_limits_per_deployment_and_in_all() -> None:
    admission = Admission(DEFAULT)
    for i in range(32):
        admission.arrive("m", f"r{i}", ready=True)
    assert [admission.arrive("m", f"w{i}", ready=True) for i in range(64)] == [QUEUED] * 64
    assert admission.arrive("m", "w64", ready=True) == Refused("queue_full")
    total = Admission(DEFAULT)
    for n in range(4):  # four models, none ready: 4 x 64 = 256 waiting in all
        assert {total.arrive(f"m{n}", f"{n}-{i}", ready=False) for i in range(64)} == {QUEUED}
    assert total.pending == 256
    assert total.arrive("m4", "x", ready=False) == Refused("queue_full")  # its own queue is empty


def test_zero_pending_means_never_wait() -> None:
    admission = Admission(QueueLimits(max_in_flight_per_instance=1, max_pending_per_deployment=0))
    assert admission.arrive("m", "a", ready=True) == GRANTED
    assert admission.arrive("m", "b", ready=True) == Refused("queue_full")
    assert admission.arrive("n", "c", ready=False) == Refused("queue_full")


def test_max_open_caps_engine_calls_over_all_models() -> None:
    admission = Admission(QueueLimits(max_open=2))
    assert admission.arrive("a", "1", ready=True) == GRANTED
    assert admission.arrive("b", "2", ready=True) == GRANTED
    assert admission.arrive("c", "3", ready=True) == Refused("device_busy")
    admission.release("a", None)
    assert admission.arrive("c", "4", ready=True) == GRANTED


def test_a_waiter_that_leaves_frees_only_its_place() -> None:
    admission = Admission(QueueLimits(max_in_flight_per_instance=1))
    admission.arrive("m", "held", ready=True)
    for name in ("a", "b", "c"):
        admission.arrive("m", name, ready=True)
    assert admission.leave("m", "b") is True
    assert admission.leave("m", "b") is False  # gone already: nothing else is freed
    assert (admission.in_flight("m"), admission.waiting("m"), admission.position("m", "c")) == (1, 2, 2)


def test_retry_after_comes_from_measured_service_and_start_times() -> None:
    admission = Admission(QueueLimits(max_in_flight_per_instance=2))
    assert admission.retry_after("m") == 1  # nothing measured yet
    for seconds in (4.0, 6.0, 5.0):
        admission.arrive("m", "x", ready=True)
        admission.release("m", seconds)
    assert admission.retry_after("m", position=1) == 5  # one round of the median service time
    assert admission.retry_after("m", position=5) == 15  # three rounds at two a round
    assert loading_retry_after([30.0, 40.0, 50.0], starting_for=12.0) == 28
    assert loading_retry_after([], starting_for=7.2) == 8
    assert loading_retry_after([10.0], starting_for=60.0) == 1


class Runner:
    """A deployment's controller as admission sees it: ready or not, a start, a wait for readiness."""

    def __init__(self, state: InstanceState = InstanceState.READY) -> None:
        self.state = state
        self.started = 0
        self.came_up = anyio.Event()

    @property
    def ready(self) -> bool:
        return self.state is InstanceState.READY

    def ask(self) -> None:
        self.started += 1
        if not self.ready:
            self.state = InstanceState.STARTING

    async def route(self, timeout: float) -> Route:
        self.ask()
        await self.came_up.wait()
        self.state = InstanceState.READY
        return Route(EngineAddress("http://engine"), 1)

    def loading(self) -> Loading:
        return Loading(str(self.state), None, [20.0])


def record(n: int | str) -> RequestRecord:
    return RequestRecord(id=str(n), deployment="m", stream=False)


async def test_with_x_llm_wait_0_a_loading_model_answers_at_once_and_starts_anyway() -> None:
    service = AdmissionService(DEFAULT, VirtualClock())
    runner = Runner(InstanceState.STOPPED)
    with pytest.raises(ModelLoading) as caught:
        async with service.admit(runner, record(1), wait=0):
            pass
    assert runner.started == 1 and runner.state is InstanceState.STARTING
    assert caught.value.extra["state"] == "starting" and caught.value.retry_after == 20
    assert service.state.waiting("m") == 0  # it left the line


async def test_with_x_llm_wait_0_a_busy_model_answers_queued_with_the_position() -> None:
    service = AdmissionService(QueueLimits(max_in_flight_per_instance=1), VirtualClock())
    runner = Runner()
    async with service.admit(runner, record("held"), wait=None):
        with pytest.raises(Queued) as caught:
            async with service.admit(runner, record("late"), wait=0):
                pass
    assert caught.value.extra["position"] == 1 and caught.value.retry_after >= 1
    assert (service.state.in_flight("m"), service.state.waiting("m")) == (0, 0)


async def test_waiters_are_served_in_arrival_order_as_slots_free() -> None:
    service = AdmissionService(QueueLimits(max_in_flight_per_instance=1), VirtualClock())
    runner = Runner()
    order: list[str] = []
    gate = anyio.Event()

    async def ask(name: str) -> None:
        async with service.admit(runner, record(name), wait=None):
            order.append(name)
            if name == "first":
                await gate.wait()

    async with anyio.create_task_group() as tg:
        tg.start_soon(ask, "first")
        await wait_until(lambda: order == ["first"])
        for name in ("a", "b", "c"):
            tg.start_soon(ask, name)
            await wait_until(lambda name=name: service.state.position("m", name) is not None)
        gate.set()
    assert order == ["first", "a", "b", "c"]
    assert (service.state.in_flight("m"), service.state.waiting("m")) == (0, 0)


async def test_requests_for_a_stopped_model_wait_for_its_start_then_go() -> None:
    service = AdmissionService(DEFAULT, VirtualClock())
    runner = Runner(InstanceState.STOPPED)
    served: list[int] = []

    async def ask(n: int) -> None:
        async with service.admit(runner, record(n), wait=None):
            served.append(n)

    async with anyio.create_task_group() as tg:
        for n in range(3):
            tg.start_soon(ask, n)
        await wait_until(lambda: service.state.waiting("m") == 3)
        assert runner.state is InstanceState.STARTING and served == []
        runner.came_up.set()
    assert sorted(served) == [0, 1, 2]


async def test_a_bounded_wait_that_runs_out_answers_queued_and_frees_its_place() -> None:
    service = AdmissionService(QueueLimits(max_in_flight_per_instance=1), VirtualClock())
    runner = Runner()
    async with service.admit(runner, record("held"), wait=None):
        with pytest.raises(Queued):
            async with service.admit(runner, record("patient"), wait=0.05):
                pass
        assert service.state.waiting("m") == 0


async def test_refusals_carry_their_codes() -> None:
    service = AdmissionService(QueueLimits(max_in_flight_per_instance=1, max_pending_per_deployment=0), VirtualClock())
    runner = Runner()
    async with service.admit(runner, record("held"), wait=None):
        with pytest.raises(QueueFull) as caught:
            async with service.admit(runner, record("x"), wait=None):
                pass
        assert "max_pending_per_deployment" in caught.value.message and caught.value.retry_after >= 1
    busy = AdmissionService(QueueLimits(max_open=1), VirtualClock())
    async with busy.admit(runner, record("held"), wait=None):
        with pytest.raises(DeviceBusy):
            async with busy.admit(Runner(), RequestRecord(id="y", deployment="other", stream=False), wait=None):
                pass


async def wait_until(condition, limit: float = 5.0) -> None:
    with anyio.fail_after(limit):
        while not condition():
            await anyio.sleep(0.001)


async def test_never_wait_still_starts_a_stopped_model_and_says_it_is_loading() -> None:
    service = AdmissionService(QueueLimits(max_pending_per_deployment=0), VirtualClock())
    runner = Runner(InstanceState.STOPPED)
    with pytest.raises(ModelLoading) as caught:
        async with service.admit(runner, record(1), wait=None):
            pass
    assert runner.started == 1 and caught.value.extra["state"] == "starting"
    assert (service.state.in_flight("m"), service.state.waiting("m")) == (0, 0)


def test_grants_at_once_says_what_arrive_would_grant_and_changes_nothing() -> None:
    admission = Admission(QueueLimits(max_in_flight_per_instance=1, max_open=2))
    assert admission.grants_at_once("m")  # never seen: a free place
    assert admission.arrive("m", "a", ready=True) == GRANTED
    assert not admission.grants_at_once("m")  # its one place is taken
    assert admission.arrive("m", "w", ready=True) == QUEUED
    admission.release("m", None)
    assert not admission.grants_at_once("m")  # a place is free, but w waits before anyone new
    assert admission.grants("m", ready=True) == ["w"]
    assert admission.grants_at_once("n")
    assert admission.arrive("n", "b", ready=True) == GRANTED
    assert not admission.grants_at_once("o")  # max_open reached over all models
    assert (admission.in_flight("m"), admission.waiting("m"), admission.open, admission.pending) == (1, 0, 2, 0)


async def test_admit_now_grants_only_what_needs_no_wait_and_its_lease_returns_the_place() -> None:
    clock = VirtualClock()
    service = AdmissionService(QueueLimits(max_in_flight_per_instance=1), clock)
    assert service.admit_now(Runner(InstanceState.STOPPED), record("cold")) is None  # not ready: admit waits
    assert service.state.waiting("m") == 0 and "m" not in service.last_used
    runner = Runner()
    lease = service.admit_now(runner, record("now"))
    assert lease is not None and service.state.in_flight("m") == 1
    assert service.admit_now(runner, record("full")) is None  # its place is taken: nothing queued
    assert service.state.waiting("m") == 0
    service.hold("m")  # draining for a switch: nothing is granted at once
    async with lease:  # entered already: the block only returns it
        assert service.state.in_flight("m") == 1
    assert service.state.in_flight("m") == 0
    assert service.admit_now(runner, record("held")) is None
    service.unhold("m", runner)
    again = service.admit_now(runner, record("again"))
    assert again is not None
    again.give_back()
    assert service.state.in_flight("m") == 0 and service.state.open == 0
