"""A deployment's controller on fake processes, in virtual time: start, crash restarts, backoff, stop, failure.

Every test runs on trio's mock clock (``virtual_time``): sleeps, timeouts and
CapyCTL's own clock are virtual and jump ahead whenever all tasks wait, so
the backoff delays are measured exactly and nothing reads real time.
"""

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
import trio

from capyctl.domain.deployments import Deployment, Desired, InstanceState, Step, next_step
from capyctl.domain.engines import EngineFamily, EngineInstall
from capyctl.domain.errors import DeploymentStopped, EngineRestarted, EngineUnavailable, LlmUnavailable
from capyctl.domain.fields import row_for
from capyctl.domain.lifecycle import EngineAddress
from capyctl.domain.memory import Holding
from capyctl.domain.scheduling import Route
from capyctl.services.controllers import ControllerSettings, ManagedController
from capyctl.services.events import Events
from capyctl.services.fleet import decode_spec
from capyctl.services.local_engines import LocalEngineEffects
from tests.fakes.ports import FakeEngineAdapter, FakeProcessControl, FakeStore, VirtualClock, virtual_time

pytestmark = pytest.mark.anyio
anyio_backend = pytest.fixture(virtual_time)
SETTINGS = ControllerSettings(startup_timeout=5, stop_grace=0.1, poll_interval=0.005, max_start_failures=3)
S = InstanceState


class World:
    def __init__(self, operator_stopped: bool = False, index: int = 0) -> None:
        self.store = FakeStore()
        self.processes = FakeProcessControl()
        self.adapter = FakeEngineAdapter()
        spec = decode_spec({"name": "m", "engine": "e", "model": "/m.gguf"})
        engine = EngineInstall(name="e", family=EngineFamily.LLAMACPP, path="/bin/e", version="0.6.0", version_text="")
        clock = VirtualClock()
        effects = LocalEngineEffects(
            spec, engine, self.adapter, self.processes, clock, lambda: 5555, Path("/tmp/capyctl-test-logs")
        )
        self.controller = ManagedController(
            Deployment(spec=spec, operator_stopped=operator_stopped),
            engine,
            self.adapter,
            effects,
            clock,
            Events(self.store, clock),
            SETTINGS,
            row_for(engine.family, engine.version),
            index=index,
        )

    def states(self) -> list[str]:
        return [e["detail"]["state"] for e in self.store.events if e["kind"] == "state_changed"]

    async def until(self, state: InstanceState, limit: float = 60) -> None:
        with anyio.fail_after(limit):
            while self.controller.status.state is not state:
                await anyio.sleep(0.001)


@pytest.fixture
async def world() -> AsyncIterator[World]:
    w = World()
    async with anyio.create_task_group() as tg:
        w.controller.bind(tg)
        yield w
        tg.cancel_scope.cancel()


async def test_an_instance_says_its_index_in_its_status_and_every_event() -> None:
    w = World(index=2)
    async with anyio.create_task_group() as tg:
        w.controller.bind(tg)
        await w.controller.route(2)
        w.controller.want(Desired.STOP)
        await w.until(S.STOPPED)
        tg.cancel_scope.cancel()
    assert w.controller.index == w.controller.status.index == 2
    kinds = {e["kind"] for e in w.store.events}
    assert {"state_changed", "engine_started"} <= kinds
    assert {e["detail"].get("instance") for e in w.store.events if "instance" in e["detail"]} == {2}


def test_the_decision_table() -> None:
    assert next_step(Desired.ON_DEMAND, S.STOPPED, 0, 3) is Step.REST  # nothing runs until asked
    assert next_step(Desired.RUN, S.STARTING, 2, 3) is Step.LAUNCH
    assert next_step(Desired.RUN, S.STARTING, 3, 3) is Step.FAIL  # the budget is spent
    assert next_step(Desired.RUN, S.FAILED, 3, 3) is Step.REST  # until an operator starts it
    assert next_step(Desired.STOP, S.FAILED, 3, 3) is Step.SETTLE  # a stop of a FAILED one shows STOPPED
    assert next_step(Desired.STOP, S.STOPPED, 0, 3) is Step.REST


async def test_a_request_starts_an_on_demand_deployment(world: World) -> None:
    assert world.controller.desired is Desired.ON_DEMAND and world.processes.spawned == []
    route = await world.controller.route(2)
    assert route == Route(EngineAddress("http://127.0.0.1:5555"), 1)
    assert world.controller.desired is Desired.RUN and world.controller.ready
    assert len(world.processes.running()) == 1
    assert world.states() == ["starting", "ready"]


async def test_a_crash_is_restarted_after_a_backoff_and_counted(world: World) -> None:
    route = await world.controller.route(2)
    world.processes.spawned[0].crash()
    crashed_at = trio.current_time()
    lost = await world.controller.lost(route, notice=1.0, broke=EngineUnavailable("connection reset"))
    assert isinstance(lost, EngineRestarted) and lost.extra["reason"] == "engine exited with status -9 while serving"
    await world.until(S.READY)
    assert len(world.processes.running()) == 1 and world.controller.status.restarts == 1
    assert trio.current_time() - crashed_at >= 0.5  # restart_delay(1)
    assert "engine_crashed" in world.store.kinds()
    assert world.states() == ["starting", "ready", "starting", "ready"]


async def test_a_connection_that_broke_while_the_engine_runs_is_not_a_restart(world: World) -> None:
    route = await world.controller.route(2)
    began = trio.current_time()
    assert await world.controller.lost(route, notice=1.0, broke=EngineUnavailable("connection reset")) is None
    assert trio.current_time() - began == pytest.approx(1.0)  # it looked for an exit for the notice, no longer


async def test_stop_terminates_and_ends_stopped(world: World) -> None:
    await world.controller.route(2)
    world.controller.want(Desired.STOP)
    await world.controller.until_settled()
    assert world.controller.status.state is S.STOPPED
    assert world.processes.spawned[0].terminated
    assert world.states()[-2:] == ["stopping", "stopped"]


async def test_stop_right_after_start_does_not_hang(world: World) -> None:
    world.controller.want(Desired.RUN)
    world.controller.want(Desired.STOP)
    with anyio.fail_after(2):
        await world.controller.until_settled()
    assert world.controller.status.state is S.STOPPED
    assert world.processes.running() == []


async def test_a_start_given_while_a_stop_is_under_way_is_not_lost(world: World) -> None:
    world.processes.stop_takes = 2.0  # the engine takes 2 s to exit
    await world.controller.route(2)
    world.controller.want(Desired.STOP)
    await world.until(S.STOPPING)
    world.controller.want(Desired.RUN)  # an operator's start while the old engine still exits
    await world.until(S.READY)
    assert [p.terminated for p in world.processes.spawned] == [True, False]
    assert len(world.processes.running()) == 1
    assert world.states() == ["starting", "ready", "stopping", "stopped", "starting", "ready"]


async def test_shutdown_by_outer_cancellation_stops_the_engine() -> None:
    w = World()
    async with anyio.create_task_group() as tg:
        w.controller.bind(tg)
        await w.controller.route(2)
        tg.cancel_scope.cancel()
    assert w.controller.status.state is S.STOPPED
    assert w.processes.spawned[0].terminated
    with anyio.fail_after(1):
        await w.controller.close()  # what CapyCTL's shutdown calls afterwards: returns at once


async def test_an_engine_that_never_starts_fails_with_its_error(world: World) -> None:
    world.processes.exit_at_once = True
    with pytest.raises(LlmUnavailable, match="exited with status 1 while starting") as caught:
        await world.controller.route(60)
    assert caught.value.code == "llm-unavailable" and "capyctl start deployment m" in caught.value.message
    assert world.controller.status.state is S.FAILED
    assert len(world.processes.spawned) == SETTINGS.max_start_failures
    with pytest.raises(LlmUnavailable):  # a FAILED deployment stays failed for requests: no new start
        await world.controller.route(60)
    assert len(world.processes.spawned) == SETTINGS.max_start_failures


async def test_a_launch_that_raises_is_a_failed_start_and_the_deployment_ends_failed(world: World) -> None:
    spawn = world.processes.spawn
    attempts: list[int] = []

    async def second_spawn_raises(*args: object) -> object:  # a log folder that cannot be made, a failed fork ...
        attempts.append(1)
        if len(attempts) == 2:
            raise OSError(28, "No space left on device")
        return await spawn(*args)  # type: ignore[arg-type]

    world.processes.spawn = second_spawn_raises  # type: ignore[method-assign]
    world.processes.exit_at_once = True
    with pytest.raises(LlmUnavailable, match="while starting"):  # the last launch's own error
        await world.controller.route(60)
    assert world.controller.status.state is S.FAILED
    assert len(attempts) == SETTINGS.max_start_failures  # the broken launch counts against the budget
    failed = [e["detail"] for e in world.store.events if e["kind"] == "engine_start_failed"]
    assert [d.get("reason", d.get("status")) for d in failed] == [
        1,
        "could not launch the engine: OSError: [Errno 28] No space left on device",
        1,
    ]
    assert [e["detail"]["after_s"] for e in world.store.events if e["kind"] == "engine_restarting"] == [0.5, 1.0]


async def test_a_readiness_probe_that_raises_is_a_failed_start_not_a_broken_controller(world: World) -> None:
    """A probe that raises while its engine still runs (an HTTP client's own fault on a socket the dying engine
    closed): the launch ends its engine and counts as a failed start, in STARTING, so the budget's last one
    ends FAILED with the launch's error, not the controller with an illegal transition."""

    async def ready(base_url: str) -> bool:
        raise AttributeError("'NoneType' object has no attribute 'getpeername'")

    world.adapter.ready = ready  # type: ignore[method-assign]
    with pytest.raises(LlmUnavailable, match="could not launch the engine: AttributeError"):
        await world.controller.route(60)
    assert world.controller.status.state is S.FAILED
    assert len(world.processes.spawned) == SETTINGS.max_start_failures
    assert all(p.returncode() is not None for p in world.processes.spawned)  # each engine was ended
    kinds = [e["kind"] for e in world.store.events]
    assert "controller_failed" not in kinds and kinds.count("engine_start_failed") == SETTINGS.max_start_failures
    assert "stopping" not in world.states()  # a failed start is not a stop


async def test_a_controller_that_meets_an_unexpected_error_fails_alone_until_an_operators_start() -> None:
    broken, healthy = World(), World()
    step = broken.controller._task.step
    raised: list[str] = []

    async def step_once_broken() -> None:
        if not raised:
            raised.append("once")
            raise RuntimeError("a bug in the controller")
        await step()

    broken.controller._task.step = step_once_broken  # type: ignore[method-assign]
    async with anyio.create_task_group() as tg:  # one task group, as the fleet's: the fault must stay in its task
        broken.controller.bind(tg)
        healthy.controller.bind(tg)
        with pytest.raises(LlmUnavailable, match="controller failed: RuntimeError: a bug in the controller"):
            await broken.controller.route(5)
        assert broken.controller.status.state is S.FAILED and broken.processes.spawned == []
        assert [e["kind"] for e in broken.store.events].count("controller_failed") == 1
        assert (await healthy.controller.route(5)).address.url == "http://127.0.0.1:5555"  # the other one serves
        with pytest.raises(LlmUnavailable):  # nothing is tried again on a request's behalf
            await broken.controller.route(1)
        assert broken.processes.spawned == []
        broken.controller.want(Desired.RUN)  # an operator's start: a new budget, and it serves
        assert (await broken.controller.route(5)).address.url == "http://127.0.0.1:5555"
        assert len(broken.processes.running()) == 1
        tg.cancel_scope.cancel()


async def test_an_engine_that_crashes_after_each_start_backs_off_then_fails(world: World) -> None:
    launched: list[float] = []

    async def ready_then_crash(base_url: str) -> bool:
        launched.append(trio.current_time())
        world.processes.spawned[-1].crash(-11)  # it answers its health check, then dies at once
        return True

    world.adapter.ready = ready_then_crash  # type: ignore[method-assign]
    world.controller.ask()
    await world.until(S.FAILED)
    assert len(world.processes.spawned) == SETTINGS.max_start_failures
    delays = [e["detail"]["after_s"] for e in world.store.events if e["kind"] == "engine_restarting"]
    assert delays == [0.5, 1.0]  # growing
    gaps = [b - a for a, b in zip(launched, launched[1:], strict=False)]
    assert gaps[0] >= 0.5 and gaps[1] >= 1.0 and gaps[1] > gaps[0]  # the delays were really waited
    with pytest.raises(LlmUnavailable, match="exited with status -11 while serving"):
        await world.controller.route(1)
    world.adapter.ready = FakeEngineAdapter().ready  # type: ignore[method-assign]  # fixed; an operator starts it
    world.controller.want(Desired.RUN)
    assert world.controller.status.state is S.STARTING  # at once: requests now wait for it
    began = trio.current_time()
    assert (await world.controller.route(5)).address.url == "http://127.0.0.1:5555"
    assert trio.current_time() - began < 0.5  # a new start budget, with no backoff before it


async def test_a_request_arriving_while_the_engine_stops_is_refused(world: World) -> None:
    world.processes.stop_takes = 2.0
    await world.controller.route(2)
    world.controller.want(Desired.STOP)
    await world.until(S.STOPPING)
    with pytest.raises(DeploymentStopped, match="capyctl start deployment m"):
        await world.controller.route(60)
    await world.until(S.STOPPED)
    assert len(world.processes.spawned) == 1  # nothing started it again


async def test_requests_waiting_for_a_start_get_deployment_stopped(world: World) -> None:
    world.adapter.healthy = False  # it stays STARTING: requests wait for it
    outcome: list[BaseException] = []

    async def request() -> None:
        try:
            await world.controller.route(60)
        except Exception as exc:  # noqa: BLE001 - recorded for the assertion below
            outcome.append(exc)

    async with anyio.create_task_group() as tg:
        for _ in range(3):
            tg.start_soon(request)
        await world.until(S.STARTING)
        world.controller.want(Desired.STOP)
    assert [type(e) for e in outcome] == [DeploymentStopped] * 3
    spawned = len(world.processes.spawned)
    world.controller.ask()  # a request's start while the operator's stop holds: nothing
    with pytest.raises(DeploymentStopped):
        await world.controller.route(1)
    assert len(world.processes.spawned) == spawned and world.controller.status.state is S.STOPPED


async def test_an_operators_stop_of_a_failed_deployment_keeps_it_down(world: World) -> None:
    world.processes.exit_at_once = True
    with pytest.raises(LlmUnavailable):
        await world.controller.route(60)
    world.controller.want(Desired.STOP)
    await world.controller.until_settled()
    assert world.controller.status.state is S.STOPPED
    assert world.controller.status.last_error == "engine exited with status 1 while starting"  # kept
    world.processes.exit_at_once = False
    world.controller.ask()
    with pytest.raises(DeploymentStopped):
        await world.controller.route(1)
    assert len(world.processes.spawned) == SETTINGS.max_start_failures


async def test_an_operators_stop_cuts_requests_with_deployment_stopped_not_engine_restarted(world: World) -> None:
    route = await world.controller.route(2)
    world.controller.want(Desired.STOP)
    lost = await world.controller.lost(route, notice=1.0, broke=EngineUnavailable("connection reset"))
    assert isinstance(lost, DeploymentStopped) and lost.code == "deployment_stopped"


async def test_a_deployment_stopped_before_capyctl_started_stays_stopped() -> None:
    w = World(operator_stopped=True)
    async with anyio.create_task_group() as tg:
        w.controller.bind(tg)
        assert w.controller.desired is Desired.STOP
        w.controller.ask()
        with pytest.raises(DeploymentStopped):
            await w.controller.route(1)
        tg.cancel_scope.cancel()
    assert w.processes.spawned == []


class Parks(World):
    """A host_backed deployment whose canary answers are the test's to set."""

    def __init__(self) -> None:
        super().__init__()
        self.answers = ["ready", "ready"]  # the first readiness, then each wake
        spec = decode_spec(
            {
                "name": "m",
                "engine": "e",
                "model": "/m.gguf",
                "residency": "host_backed",
                "resources": {"memory": "4GiB", "parked_memory": "1GiB"},
            }
        )
        old = self.controller
        effects = LocalEngineEffects(
            spec,
            old.engine,
            self.adapter,
            self.processes,
            VirtualClock(),
            lambda: 5555,
            Path("/tmp/capyctl-test-logs"),
            canary=self.canary,
        )
        self.controller = ManagedController(
            Deployment(spec=spec),
            old.engine,
            self.adapter,
            effects,
            VirtualClock(),
            Events(self.store, VirtualClock()),
            SETTINGS,
            old.fields,
        )

    async def canary(self, base_url: str, model: str) -> str:
        return self.answers.pop(0)


@pytest.fixture
async def parks() -> AsyncIterator[Parks]:
    w = Parks()
    async with anyio.create_task_group() as tg:
        w.controller.bind(tg)
        yield w
        tg.cancel_scope.cancel()


async def test_park_then_a_request_wakes_it(parks: Parks) -> None:
    await parks.controller.route(5)
    await parks.controller.give_way(park=True)
    assert parks.controller.status.state is S.PARKED and parks.controller.holding is Holding.PARKED
    assert parks.adapter.calls == ["park host_backed"] and len(parks.processes.running()) == 1
    assert (await parks.controller.route(5)).launch == 1  # the same engine, woken
    assert parks.adapter.calls == ["park host_backed", "wake host_backed"]
    assert parks.controller.holding is Holding.AWAKE and len(parks.controller.status.wake_times) == 1
    assert "parked" in parks.store.kinds() and "woken" in parks.store.kinds()


async def test_a_wake_whose_canary_differs_stops_the_engine_and_a_fresh_one_serves(parks: Parks) -> None:
    parks.answers = ["ready", "garbage", "ready"]
    await parks.controller.route(5)
    await parks.controller.give_way(park=True)
    route = await parks.controller.route(30)  # the wake mismatches: stopped, started afresh for this request
    assert route.launch == 2 and parks.processes.spawned[0].terminated
    assert "wake_mismatch" in parks.store.kinds()
    assert "wake_mismatch" in str(parks.controller.status.last_error)
    await parks.controller.give_way(park=True)  # the new engine parks and is charged as parked
    assert parks.controller.holding is Holding.PARKED


async def test_a_park_the_engine_does_not_confirm_becomes_a_stop(parks: Parks) -> None:
    async def still_awake(base_url: str, residency: object) -> None:
        parks.adapter.calls.append("park refused")

    parks.adapter.park = still_awake  # type: ignore[method-assign]  # answers, but never sleeps
    await parks.controller.route(5)
    await parks.controller.give_way(park=True)
    assert parks.controller.holding is Holding.NONE and parks.processes.running() == []  # freed by the stop
    assert parks.controller.desired is Desired.ON_DEMAND and "park_failed" in parks.store.kinds()
