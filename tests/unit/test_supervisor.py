"""The supervisor's lifecycle on fake processes: start, crash restarts, stop, failure."""

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from capyctl.domain.deployments import Deployment, InstanceState
from capyctl.domain.engines import EngineFamily, EngineInstall
from capyctl.domain.errors import DeploymentStopped, LlmUnavailable
from capyctl.domain.fields import row_for
from capyctl.services.events import Events
from capyctl.services.fleet import decode_spec
from capyctl.services.supervisor import Supervisor, SupervisorSettings
from tests.fakes.ports import FakeClock, FakeEngineAdapter, FakeProcessControl, FakeStore

pytestmark = pytest.mark.anyio
SETTINGS = SupervisorSettings(startup_timeout=0.5, stop_grace=0.1, poll_interval=0.005, max_start_failures=3)


class World:
    def __init__(self) -> None:
        self.store = FakeStore()
        self.processes = FakeProcessControl()
        self.adapter = FakeEngineAdapter()
        spec = decode_spec({"name": "m", "engine": "e", "model": "/m.gguf"})
        engine = EngineInstall(name="e", family=EngineFamily.LLAMACPP, path="/bin/e", version="0.6.0", version_text="")
        self.supervisor = Supervisor(
            Deployment(spec=spec), engine, self.adapter, self.processes, FakeClock(),
            Events(self.store, FakeClock()), lambda: 5555, Path("/tmp/capyctl-test-logs"), SETTINGS,
            row_for(engine.family, engine.version),
        )

    def states(self) -> list[str]:
        return [e["detail"]["state"] for e in self.store.events if e["kind"] == "state_changed"]


@pytest.fixture
async def world() -> AsyncIterator[World]:
    w = World()
    async with anyio.create_task_group() as tg:
        w.supervisor.bind(tg)
        yield w
        tg.cancel_scope.cancel()


async def test_wait_ready_starts_the_engine(world: World) -> None:
    url = await world.supervisor.wait_ready(2)
    assert url == "http://127.0.0.1:5555"
    assert world.supervisor.status.state is InstanceState.READY
    assert len(world.processes.running()) == 1
    assert world.states() == ["starting", "ready"]


async def test_a_crash_is_restarted_and_counted(world: World) -> None:
    await world.supervisor.wait_ready(2)
    first = world.processes.spawned[0]
    launch = world.supervisor.launch
    first.crash()
    with anyio.fail_after(3):
        while len(world.processes.running()) != 1 or world.supervisor.status.state is not InstanceState.READY:
            await anyio.sleep(0.01)
    assert world.supervisor.engine_gone(launch)
    assert world.supervisor.status.restarts == 1
    assert "engine_crashed" in world.store.kinds()
    assert world.states() == ["starting", "ready", "starting", "ready"]


async def test_stop_terminates_and_ends_stopped(world: World) -> None:
    await world.supervisor.wait_ready(2)
    await world.supervisor.stop()
    assert world.supervisor.status.state is InstanceState.STOPPED
    assert world.processes.spawned[0].terminated
    assert world.states()[-2:] == ["stopping", "stopped"]


async def test_stop_right_after_start_does_not_hang(world: World) -> None:
    world.supervisor.start()
    with anyio.fail_after(2):
        await world.supervisor.stop()
    assert world.supervisor.status.state is InstanceState.STOPPED
    assert world.processes.running() == []


async def test_shutdown_by_outer_cancellation_stops_the_engine() -> None:
    w = World()
    async with anyio.create_task_group() as tg:
        w.supervisor.bind(tg)
        await w.supervisor.wait_ready(2)
        tg.cancel_scope.cancel()
    assert w.supervisor.status.state is InstanceState.STOPPED
    assert w.processes.spawned[0].terminated
    with anyio.fail_after(1):
        await w.supervisor.stop()  # what CapyCTL's shutdown calls afterwards: returns at once


async def test_an_engine_that_never_starts_fails_with_its_error(world: World) -> None:
    world.processes.exit_at_once = True
    with pytest.raises(LlmUnavailable, match="exited with status 1 while starting") as caught:
        await world.supervisor.wait_ready(10)
    assert caught.value.code == "llm-unavailable" and "capyctl start deployment m" in caught.value.message
    assert world.supervisor.status.state is InstanceState.FAILED
    assert len(world.processes.spawned) == SETTINGS.max_start_failures
    with pytest.raises(LlmUnavailable):  # a FAILED deployment stays failed for requests: no new start
        await world.supervisor.wait_ready(10)
    assert len(world.processes.spawned) == SETTINGS.max_start_failures


async def test_an_engine_that_crashes_after_each_start_backs_off_then_fails(world: World) -> None:
    async def ready_then_crash(base_url: str) -> bool:
        world.processes.spawned[-1].crash(-11)  # it answers its health check, then dies at once
        return True

    world.adapter.ready = ready_then_crash  # type: ignore[method-assign]
    world.supervisor.start()
    with anyio.fail_after(10):
        while world.supervisor.status.state is not InstanceState.FAILED:
            await anyio.sleep(0.01)
    assert len(world.processes.spawned) == SETTINGS.max_start_failures
    delays = [e["detail"]["after_s"] for e in world.store.events if e["kind"] == "engine_restarting"]
    assert delays == [0.5, 1.0]  # growing
    with pytest.raises(LlmUnavailable, match="exited with status -11 while serving"):
        await world.supervisor.wait_ready(1)
    world.adapter.ready = FakeEngineAdapter().ready  # type: ignore[method-assign]  # fixed; an operator starts it
    world.supervisor.start()
    assert await world.supervisor.wait_ready(5) == "http://127.0.0.1:5555"


async def test_an_operators_stop_is_sticky_while_stopping_and_for_waiting_requests(world: World) -> None:
    world.adapter.healthy = False  # it stays STARTING: a request waits for it
    waiting = anyio.Event()
    outcome: list[BaseException] = []

    async def request() -> None:
        waiting.set()
        try:
            await world.supervisor.wait_ready(10)
        except Exception as exc:  # noqa: BLE001 - recorded for the assertion below
            outcome.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(request)
        await waiting.wait()
        world.supervisor.deployment.operator_stopped = True  # what Fleet.stop sets before stopping
        await world.supervisor.stop()
    assert [type(e) for e in outcome] == [DeploymentStopped]
    spawned = len(world.processes.spawned)
    world.supervisor.start()  # a request's start while the operator's stop holds: nothing
    with pytest.raises(DeploymentStopped):
        await world.supervisor.wait_ready(1)
    assert len(world.processes.spawned) == spawned and world.supervisor.status.state is InstanceState.STOPPED


async def test_an_operators_stop_of_a_failed_deployment_keeps_it_down(world: World) -> None:
    world.processes.exit_at_once = True
    with pytest.raises(LlmUnavailable):
        await world.supervisor.wait_ready(10)
    world.supervisor.deployment.operator_stopped = True
    world.processes.exit_at_once = False
    world.supervisor.start()
    with pytest.raises(DeploymentStopped):
        await world.supervisor.wait_ready(1)
    assert len(world.processes.spawned) == SETTINGS.max_start_failures


async def test_engine_environment_changes_reach_the_child(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real child process: variables the adapter sets are there, the ones it removes are gone."""
    from capyctl.adapters.process.children import PopenProcessControl

    monkeypatch.setenv("LLAMA_ARG_API_KEY", "leaked")
    monkeypatch.setenv("KEEP_ME", "kept")
    log = tmp_path / "env.log"
    process = await PopenProcessControl().spawn(
        ["sh", "-c", 'echo "key=${LLAMA_ARG_API_KEY-unset} keep=$KEEP_ME new=$NEW"'], log,
        {"LLAMA_ARG_API_KEY": None, "NEW": "1"},
    )
    with anyio.fail_after(5):
        while process.returncode() is None:
            await anyio.sleep(0.01)
    assert log.read_text().strip() == "key=unset keep=kept new=1"
