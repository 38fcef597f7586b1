"""The managed controller over a fake ``EngineEffects``: what it does to its engines, and when it lets go.

The fake records each effect (``done``); the tests wait on conditions (an
effect, an event), bounded in trio's virtual time, never on a sleep.
"""

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
import pytest

from capyctl.domain.deployments import Deployment, Desired, InstanceState
from capyctl.domain.engines import EngineFamily, EngineInstall
from capyctl.domain.errors import DeviceOffline, EngineRestarted, EngineUnavailable, InsufficientMemory, LlmUnavailable
from capyctl.domain.fields import row_for
from capyctl.domain.lifecycle import EngineAddress
from capyctl.domain.memory import Holding
from capyctl.domain.ports import EngineLoad
from capyctl.domain.requests import RequestRecord
from capyctl.domain.scheduling import Route
from capyctl.services.controllers import ControllerSettings, ManagedController, Room
from capyctl.services.events import Events
from capyctl.services.fleet import decode_spec
from capyctl.services.switching import Occupant
from tests.fakes.effects import FakeEngineEffects
from tests.fakes.ports import FakeEngineAdapter, FakeStore, VirtualClock, virtual_time

pytestmark = pytest.mark.anyio
anyio_backend = pytest.fixture(virtual_time)
SETTINGS = ControllerSettings(startup_timeout=5, stop_grace=0.1, poll_interval=0.005, max_start_failures=3)
S = InstanceState


class RefusingRoom:
    """A device with no room for anyone."""

    def __init__(self) -> None:
        self.claims: list[str] = []

    async def claim(self, occupant: Occupant) -> None:
        self.claims.append(occupant.name)
        raise InsufficientMemory(occupant.name, "needs 4 GiB, 1 GiB free", 30)


class World:
    def __init__(self, residency: str = "restart_only", room: Room | None = None) -> None:
        self.store = FakeStore()
        self.effects = FakeEngineEffects()
        clock = VirtualClock()
        events = Events(self.store, clock)
        events.listen(lambda *_: self.effects.notify())  # a test waiting on a condition looks again at each event
        document = {"name": "m", "engine": "e", "model": "/m.gguf", "residency": residency}
        if residency != "restart_only":
            document["resources"] = {"memory": "4GiB", "parked_memory": "1GiB"}
        engine = EngineInstall(name="e", family=EngineFamily.LLAMACPP, path="/bin/e", version="0.6.0", version_text="")
        self.controller = ManagedController(
            Deployment(spec=decode_spec(document)),
            engine,
            FakeEngineAdapter(),
            self.effects,  # type: ignore[arg-type]
            clock,
            events,
            SETTINGS,
            row_for(engine.family, engine.version),
            room,
        )

    async def until(self, condition: Callable[[], bool], limit: float = 60) -> None:
        with anyio.fail_after(limit):
            while not condition():
                await self.effects.changed.wait()

    def kinds(self) -> list[str]:
        return self.store.kinds()


@asynccontextmanager
async def bound(world: World) -> AsyncIterator[World]:
    async with anyio.create_task_group() as tg:
        world.controller.bind(tg)
        yield world
        tg.cancel_scope.cancel()


@pytest.fixture
async def world() -> AsyncIterator[World]:
    async with bound(World()) as w:
        yield w


@pytest.fixture
async def parks() -> AsyncIterator[World]:
    async with bound(World("host_backed")) as w:
        yield w


async def test_a_request_launches_one_engine_and_is_routed_to_it(world: World) -> None:
    assert await world.controller.route(5) == Route(EngineAddress("http://engine-1"), 1)
    assert world.effects.done == ["launch 1"] and world.effects.running() == [1]
    status = world.controller.status
    assert (status.pid, status.log_path) == (101, "/logs/1.log") and world.controller.holding is Holding.AWAKE


async def test_a_crash_ends_the_old_engine_before_the_next_launch(world: World) -> None:
    route = await world.controller.route(5)
    world.effects.crash(1)
    assert isinstance(
        await world.controller.lost(route, notice=1.0, broke=EngineUnavailable("connection reset")), EngineRestarted
    )
    await world.until(lambda: world.controller.ready)
    assert world.effects.done == ["launch 1", "stop 1", "launch 2"]
    assert world.controller.route_now() == Route(EngineAddress("http://engine-2"), 2)


async def test_an_engine_its_hosts_agent_stopped_is_no_crash_and_comes_back_without_backoff(world: World) -> None:
    for launch in range(1, 6):  # more ends than the start budget (3): none of them is counted against it
        route = await world.controller.route(5)
        assert route.launch == launch
        began = anyio.current_time()
        world.effects.crash(launch, code=0, cause="agent_stopped")
        await world.until(lambda: world.controller.ready and world.controller.status.pid == 100 + launch + 1)  # noqa: B023
        assert anyio.current_time() - began < 0.5  # no backoff: the launch itself waits for the host
    assert world.controller.status.state is S.READY and "engine_crashed" not in world.kinds()
    ended = [e["detail"] for e in world.store.events if e["kind"] == "engine_ended"]
    assert len(ended) == 5 and {e["cause"] for e in ended} == {"agent_stopped"}
    assert "agent was stopped" in str(world.controller.status.last_error)
    world.effects.crash(6, code=-9)  # by itself: a crash, said so
    await world.until(lambda: "engine_crashed" in world.kinds())


async def test_memory_and_cut_requests_are_released_only_once_the_engine_is_gone(world: World) -> None:
    await world.controller.route(5)
    world.controller.cut(RequestRecord(id="r1", deployment="m", stream=True))  # cut before any output
    world.effects.stop_gate = gate = anyio.Event()  # the engine takes its time to exit
    world.controller.want(Desired.STOP)
    await world.until(lambda: "stop 1" in world.effects.done)
    with anyio.move_on_after(3600):  # an hour later, the engine still not gone: nothing is released by time
        await gate.wait()
    assert world.controller.status.state is S.STOPPING
    assert world.controller.holding is Holding.AWAKE and world.controller.unsettled_before_output() == 1
    gate.set()  # the engine is gone
    await world.until(lambda: world.controller.status.state is S.STOPPED)
    assert world.controller.holding is Holding.NONE and world.controller.unsettled_before_output() == 0
    assert world.effects.running() == [] and "request_settled" in world.kinds()


async def test_an_engine_that_never_gets_ready_is_ended_each_time_then_failed(world: World) -> None:
    world.effects.healthy = False
    with pytest.raises(LlmUnavailable, match="engine not ready after 5 s"):
        await world.controller.route(600)
    launches = [d for d in world.effects.done if d.startswith("launch")]
    assert launches == ["launch 1", "launch 2", "launch 3"] and world.effects.running() == []
    assert {d for d in world.effects.done if d.startswith("stop")} == {"stop 1", "stop 2", "stop 3"}


async def test_a_launch_that_raises_is_a_failed_start_and_the_next_one_serves(world: World) -> None:
    world.effects.launch_error = OSError(28, "No space left on device")
    assert await world.controller.route(30) == Route(EngineAddress("http://engine-2"), 2)
    assert world.effects.done == ["launch 2"]  # nothing ran for launch 1: nothing to stop
    assert "engine_start_failed" in world.kinds() and world.controller.status.restarts == 1


async def test_no_room_is_told_to_the_request_and_nothing_is_launched() -> None:
    room = RefusingRoom()
    async with bound(World(room=room)) as w:
        with pytest.raises(InsufficientMemory):
            await w.controller.route(30)
        assert room.claims == ["m"] and w.effects.done == []
        assert w.controller.status.state is S.STOPPED and w.controller.desired is Desired.ON_DEMAND


async def test_close_ends_the_engine(world: World) -> None:
    await world.controller.route(5)
    await world.controller.close()
    assert world.effects.done == ["launch 1", "stop 1"] and world.effects.running() == []
    assert world.controller.status.state is S.STOPPED


async def test_park_and_wake_act_on_the_same_engine(parks: World) -> None:
    await parks.controller.route(5)
    await parks.controller.give_way(park=True)
    assert parks.effects.done == ["launch 1", "canary 1", "park 1"]  # the canary's first answer, then the park
    assert parks.controller.status.state is S.PARKED and parks.controller.holding is Holding.PARKED
    assert await parks.controller.route(5) == Route(EngineAddress("http://engine-1"), 1)
    assert parks.effects.done[3:] == ["wake 1", "canary 1"] and parks.controller.holding is Holding.AWAKE
    assert parks.effects.running() == [1]


async def test_a_park_the_engine_denies_becomes_a_stop(parks: World) -> None:
    parks.effects.parks = False  # it answers the park, then says it is awake
    await parks.controller.route(5)
    await parks.controller.give_way(park=True)  # returns once the process is gone
    assert parks.effects.done == ["launch 1", "canary 1", "park 1", "stop 1"]
    assert parks.controller.holding is Holding.NONE and parks.controller.desired is Desired.ON_DEMAND
    assert "did not park" in str(parks.controller.status.last_error)


async def test_a_wake_that_answers_differently_is_stopped_and_a_fresh_engine_serves(parks: World) -> None:
    parks.effects.answers = ["yes", "no", "yes"]
    await parks.controller.route(5)
    await parks.controller.give_way(park=True)
    assert await parks.controller.route(30) == Route(EngineAddress("http://engine-2"), 2)
    assert parks.effects.done == [
        "launch 1",
        "canary 1",
        "park 1",
        "wake 1",
        "canary 1",
        "stop 1",
        "launch 2",
        "canary 2",
    ]
    assert "wake_mismatch" in parks.kinds()


async def test_an_engine_whose_machine_is_out_of_reach_is_refused_at_once_and_served_again_after(world: World) -> None:
    assert await world.controller.route(5) == Route(EngineAddress("http://engine-1"), 1)
    world.effects.unreachable = DeviceOffline("gpu-a", "suspended", model="m")
    assert world.controller.route_now() is None  # no request goes to it
    with pytest.raises(DeviceOffline) as refused:  # told at once: not after the request's deadline
        with anyio.fail_after(0.001):
            await world.controller.route(5)
    assert refused.value.extra["model"] == "m" and refused.value.retry_after > 0
    assert world.effects.done == ["launch 1"]  # its engine is kept: nothing is stopped or launched again
    world.effects.unreachable = None
    assert world.controller.route_now() == Route(EngineAddress("http://engine-1"), 1)


async def test_cut_requests_are_settled_by_the_running_launchs_own_load_readings(world: World) -> None:
    await world.controller.route(5)
    world.effects.load_now = EngineLoad(1, 0)  # still working on what was cut
    world.controller.cut(RequestRecord(id="r1", deployment="m", stream=True, answered=True))
    await world.until(lambda: len(world.effects.loads) >= 2)
    assert set(world.effects.loads) == {1} and world.controller.settlement.ledger.counts() != []
    world.effects.load_now = EngineLoad(0, 0)
    await world.until(lambda: world.controller.settlement.ledger.counts() == [])
    assert "request_settled" in world.kinds()
