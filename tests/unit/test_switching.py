"""Switching models on one device, on fake processes in virtual time: the fleet, its controllers, admission
and the switchboard together, requests going through admission as the chat path sends them."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
import trio

from capyctl.domain.config import Switching
from capyctl.domain.engines import EngineFamily, EngineInstall
from capyctl.domain.errors import CapyError, GpuBusy, InsufficientMemory
from capyctl.domain.memory import Device, Idle
from capyctl.domain.requests import RequestRecord
from capyctl.domain.scheduling import QueueLimits
from capyctl.services.admission import AdmissionService
from capyctl.services.controllers import ControllerSettings
from capyctl.services.events import Events
from capyctl.services.fleet import Fleet
from capyctl.services.switching import Switchboard
from tests.fakes.ports import FakeEngineAdapter, FakeProcessControl, FakeStore, VirtualClock, virtual_time

pytestmark = pytest.mark.anyio
anyio_backend = pytest.fixture(virtual_time)
GiB = 2**30
SETTINGS = ControllerSettings(startup_timeout=60, stop_grace=0.1, poll_interval=0.01, max_start_failures=3)


class World:
    def __init__(self, tmp_path: Path, capacity: float = 2.5, drain_timeout: float = 30.0) -> None:
        self.store = FakeStore()
        self.processes = CountingProcesses()
        self.store.put_engine(
            EngineInstall(name="e", family=EngineFamily.LLAMACPP, path="/bin/e", version="0.6.0", version_text="")
        )
        self.model = tmp_path / "m.gguf"
        self.model.write_bytes(b"GGUF")
        clock = VirtualClock()
        events = Events(self.store, clock)
        self.admission = AdmissionService(QueueLimits(), clock, 1800.0)
        self.board = Switchboard(
            [Device(name="gpu0", capacity=int(capacity * GiB))],
            Switching(admission_window=2.0, drain_timeout=drain_timeout),
            self.admission,
            clock,
            events,
        )
        ports = itertools.count(7000)
        self.fleet = Fleet(
            self.store,
            {"llamacpp": FakeEngineAdapter()},
            self.processes,
            clock,
            events,  # type: ignore[dict-item]
            lambda: next(ports),
            tmp_path / "logs",
            SETTINGS,
            self.board,
        )
        self.board.bind(self.fleet.controllers)
        self.answered: list[str] = []
        self.refused: list[CapyError] = []
        self.ids = itertools.count()

    async def deploy(self, *names: str, memory: str = "1GiB") -> None:
        for name in names:
            await self.fleet.apply(
                {"name": name, "engine": "e", "model": str(self.model), "resources": {"memory": memory}}, activate=False
            )

    async def request(self, name: str, holds_for: float = 0.5) -> None:
        """One request the way the chat path sends it: a lease, the engine's URL, then the engine's time."""
        controller = self.fleet.instances(name)[0]
        record = RequestRecord(id=f"{name}-{next(self.ids)}", deployment=name, stream=False)
        try:
            async with self.admission.admit(controller, record, None):
                await controller.route(1800)
                assert controller.ready and controller.holding.value == "awake"  # at the engine, with room held
                await anyio.sleep(holds_for)
            self.answered.append(name)
        except CapyError as exc:
            self.refused.append(exc)

    def kinds(self, kind: str) -> list[dict]:
        return [e["detail"] for e in self.store.events if e["kind"] == kind]


class CountingProcesses(FakeProcessControl):
    """Fake engine processes that remember the most that ever ran at once."""

    def __init__(self) -> None:
        super().__init__()
        self.most = 0

    async def spawn(self, argv, log_path, env):  # type: ignore[no-untyped-def]
        process = await super().spawn(argv, log_path, env)
        self.most = max(self.most, len(self.running()))
        return process


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    w = World(tmp_path)
    async with anyio.create_task_group() as tg:
        await tg.start(w.fleet.run)
        yield w
        tg.cancel_scope.cancel()


async def test_two_fit_and_the_third_switches_the_least_recently_used_out(world: World) -> None:
    await world.deploy("a", "b", "c")
    await world.request("a")
    await anyio.sleep(1)
    await world.request("b")
    assert len(world.processes.running()) == 2
    await world.request("c")  # a is idle and was used longest ago
    assert world.answered == ["a", "b", "c"] and world.refused == []
    assert world.processes.most == 2  # never three engines at once
    (planned,) = world.kinds("switch_planned")
    assert planned["target"] == "c" and [v["name"] for v in planned["victims"]] == ["a"]
    assert planned["victims"][0]["action"] == "stop"  # restart_only
    assert len(world.kinds("switch_completed")) == 1
    assert world.fleet.get("a").desired.value == "on_demand"  # an idle-made stop is not sticky
    await world.request("a")  # and a request starts it again, switching b out
    assert world.answered[-1] == "a" and world.processes.most == 2


async def test_a_victim_keeps_its_own_traffic_for_the_window_then_drains_and_nothing_is_cut(world: World) -> None:
    await world.deploy("a", "b", "c")
    await world.request("b")
    began = trio.current_time()
    async with anyio.create_task_group() as tg:
        tg.start_soon(world.request, "a", 5.0)  # a long answer at a
        await anyio.sleep(0.5)
        tg.start_soon(world.request, "c", 0.1)  # c must switch a or b out: b is idle, used longer ago
        await anyio.sleep(0.5)
    assert sorted(world.answered) == ["a", "b", "c"] and world.refused == []
    (planned,) = world.kinds("switch_planned")
    assert [v["name"] for v in planned["victims"]] == ["b"]  # the idle one; its window closed at once
    assert trio.current_time() - began < 6


async def test_a_busy_victim_drains_after_the_window_and_its_new_requests_wait(tmp_path: Path) -> None:
    w = World(tmp_path, capacity=1.5)  # one model at a time
    async with anyio.create_task_group() as outer:
        await outer.start(w.fleet.run)
        await w.deploy("a", "c")
        stamps: dict[str, float] = {}

        async def timed(name: str, holds: float, key: str) -> None:
            await w.request(name, holds)
            stamps[key] = trio.current_time()

        began = trio.current_time()
        async with anyio.create_task_group() as tg:
            tg.start_soon(timed, "a", 4.0, "a-first")
            await anyio.sleep(0.5)
            tg.start_soon(timed, "c", 0.1, "c")  # plans a switch at 0.5: a admits until 2.5
            await anyio.sleep(1.0)
            tg.start_soon(timed, "a", 0.1, "a-in-window")  # 1.5: inside the window, admitted at once
            await anyio.sleep(1.5)
            tg.start_soon(timed, "a", 0.1, "a-after-window")  # 3.0: drained: waits for c's turn
        outer.cancel_scope.cancel()
    assert w.refused == [] and sorted(w.answered) == ["a", "a", "a", "c"]
    assert stamps["a-in-window"] - began < 2.0  # served by the loaded a during the window
    assert stamps["a-first"] < stamps["c"] < stamps["a-after-window"]  # the long one finished: nothing cut
    assert w.processes.most == 1


async def test_a_drain_that_runs_out_fails_the_switch_and_the_victim_keeps_serving(tmp_path: Path) -> None:
    w = World(tmp_path, capacity=1.5, drain_timeout=5.0)
    async with anyio.create_task_group() as outer:
        await outer.start(w.fleet.run)
        await w.deploy("a", "c")
        async with anyio.create_task_group() as tg:
            tg.start_soon(w.request, "a", 60.0)  # far longer than the window and the drain
            await anyio.sleep(0.5)
            tg.start_soon(w.request, "c", 0.1)
            await anyio.sleep(10)
            assert [type(e) for e in w.refused] == [GpuBusy]
            assert w.refused[0].retry_after >= 1 and "drain_timeout" in w.refused[0].message
            assert w.fleet.get("a").ready and len(w.processes.running()) == 1  # a still serves
            tg.start_soon(w.request, "a", 0.1)  # and admits again
            await anyio.sleep(1)
            assert w.answered == ["a"]
        assert w.answered == ["a", "a"]
        assert len(w.kinds("switch_failed")) == 1
        outer.cancel_scope.cancel()


async def test_a_model_that_can_never_fit_is_refused_at_once(world: World) -> None:
    await world.deploy("huge", memory="3GiB")
    began = trio.current_time()
    await world.request("huge")
    assert [type(e) for e in world.refused] == [InsufficientMemory]
    assert "needs 3.00 GiB" in world.refused[0].message and trio.current_time() - began < 1
    assert world.processes.spawned == []
    assert world.fleet.get("huge").status.state.value == "stopped"
    await world.request("huge")  # asked again: refused again at once, never a loop of evictions
    assert len(world.refused) == 2 and world.processes.spawned == []


async def test_one_switch_serves_a_whole_wave(world: World) -> None:
    await world.deploy("a", "b", "c")
    await world.request("a")
    await world.request("b")
    async with anyio.create_task_group() as tg:
        for _ in range(8):
            tg.start_soon(world.request, "c", 0.2)
    assert world.answered.count("c") == 8
    assert len(world.kinds("switch_planned")) == 1


async def test_the_model_whose_request_waited_longest_goes_first(tmp_path: Path) -> None:
    w = World(tmp_path, capacity=1.5)
    order: list[str] = []
    async with anyio.create_task_group() as outer:
        await outer.start(w.fleet.run)
        await w.deploy("a", "b", "c")

        async def first_use(name: str, holds: float) -> None:
            await w.request(name, holds)
            order.append(name)

        async with anyio.create_task_group() as tg:
            tg.start_soon(first_use, "a", 3.0)
            await anyio.sleep(0.5)
            tg.start_soon(first_use, "c", 0.1)  # waits first
            await anyio.sleep(0.5)
            tg.start_soon(first_use, "b", 0.1)  # waits second
        outer.cancel_scope.cancel()
    assert order == ["a", "c", "b"] and w.processes.most == 1


async def test_idle_timers_park_or_stop_a_quiet_model_and_not_a_busy_one(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.board._idle = Idle(stop_after=30.0)  # the server's default
    async with anyio.create_task_group() as outer:
        await outer.start(w.fleet.run)
        await w.deploy("a", "b")
        await w.fleet.apply(
            {"name": "quick", "engine": "e", "model": str(w.model), "idle": {"stop_after": "5s"}}, activate=False
        )
        async with anyio.create_task_group() as tg:
            tg.start_soon(w.request, "a", 60.0)  # busy for a minute: never idle meanwhile
            tg.start_soon(w.request, "b", 0.1)
            tg.start_soon(w.request, "quick", 0.1)
            await anyio.sleep(10)
            assert w.fleet.get("quick").status.state.value == "stopped"  # its own 5 s
            assert w.fleet.get("b").ready  # the server's 30 s are not up yet
            await anyio.sleep(25)
            assert w.fleet.get("b").status.state.value == "stopped" and w.fleet.get("a").ready
        assert w.fleet.get("a").desired.value == "run"
        await anyio.sleep(40)
        assert w.fleet.get("a").status.state.value == "stopped"  # idle once its request ended
        assert w.fleet.get("quick").desired.value == "on_demand"  # an idle stop is not sticky
        stops = [e for e in w.store.events if e["kind"] == "idle_stop"]
        assert sorted(e["deployment"] for e in stops) == ["a", "b", "quick"]
        await w.request("quick")  # and the next request starts it again
        assert w.answered[-1] == "quick"
        outer.cancel_scope.cancel()


async def test_an_idle_timer_that_meets_an_error_leaves_the_others_running(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.board._idle = Idle(stop_after=5.0)
    async with anyio.create_task_group() as outer:  # the fleet's task group: an error escaping it ends every model
        await outer.start(w.fleet.run)
        await w.deploy("a", "b")
        await w.request("a", 0.1)
        await w.request("b", 0.1)
        broken = w.fleet.get("a").members[0]

        async def give_way(park: bool = False, why: str = "") -> None:
            raise RuntimeError("a bug on the way out")

        broken.give_way = give_way  # type: ignore[method-assign]
        await anyio.sleep(10)
        assert w.fleet.get("b").status.state.value == "stopped"  # b's timer did its work
        assert broken.ready  # a's failed; it still serves
        await w.request("a", 0.1)
        assert w.answered[-1] == "a"
        del broken.give_way  # fixed: the timers go on looking, and stop it now
        await anyio.sleep(10)
        assert broken.status.state.value == "stopped"
        outer.cancel_scope.cancel()
