"""Changes to the fleet are serialised: no interleaving of apply, start, stop and delete leaves an engine
running that no command can see, or loses a command. Fake processes, virtual time."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import anyio
import pytest

from capyctl.domain.deployments import Desired, InstanceState
from capyctl.domain.engines import EngineFamily, EngineInstall
from capyctl.domain.errors import DeploymentNotFound, DeploymentStopped, InvalidConfig
from capyctl.services.controllers import ControllerSettings
from capyctl.services.events import Events
from capyctl.services.fleet import Fleet
from tests.fakes.ports import FakeEngineAdapter, FakeProcessControl, FakeStore, VirtualClock, virtual_time

pytestmark = pytest.mark.anyio
anyio_backend = pytest.fixture(virtual_time)
SETTINGS = ControllerSettings(startup_timeout=5, stop_grace=0.1, poll_interval=0.005, max_start_failures=3)


class World:
    def __init__(self, tmp_path: Path) -> None:
        self.store = FakeStore()
        self.processes = FakeProcessControl()
        self.processes.stop_takes = 1.0  # an engine takes a while to exit: the window where races happen
        self.store.put_engine(
            EngineInstall(name="e", family=EngineFamily.LLAMACPP, path="/bin/e", version="0.6.0", version_text="")
        )
        self.model = tmp_path / "m.gguf"
        self.model.write_bytes(b"GGUF")
        ports = itertools.count(6000)
        clock = VirtualClock()
        self.fleet = Fleet(
            self.store,
            {"llamacpp": FakeEngineAdapter()},
            self.processes,
            clock,  # type: ignore[dict-item]
            Events(self.store, clock),
            lambda: next(ports),
            tmp_path / "logs",
            SETTINGS,
        )

    def document(self, args: list[str] | None = None) -> dict:
        return {"name": "m", "engine": "e", "model": str(self.model), "engine_config": {"extra_args": args or []}}

    def visible_pids(self) -> set[int]:
        return {c.status.pid for c in self.fleet.controllers() if c.status.pid is not None}

    def running_pids(self) -> set[int]:
        return {p.pid for p in self.processes.running()}

    async def settled(self) -> None:
        """Wait until no engine is between states (bounded, in virtual time)."""
        with anyio.fail_after(60):
            while any(
                c.status.state in (InstanceState.STARTING, InstanceState.STOPPING) for c in self.fleet.controllers()
            ) or any(p.terminated and p.code is None for p in self.processes.spawned):
                await anyio.sleep(0.01)


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    w = World(tmp_path)
    async with anyio.create_task_group() as tg:
        await tg.start(w.fleet.run)
        yield w
        tg.cancel_scope.cancel()
    assert w.processes.running() == []  # CapyCTL's shutdown left no engine behind


async def at_once(*commands: Callable[[], Awaitable[object]]) -> list[BaseException | None]:
    """Run the commands concurrently, each started before the previous one finished; their outcomes."""
    outcomes: list[BaseException | None] = [None] * len(commands)

    async def one(i: int) -> None:
        try:
            await commands[i]()
        except Exception as exc:  # noqa: BLE001 - the outcome is what the test looks at
            outcomes[i] = exc

    async with anyio.create_task_group() as tg:
        for i in range(len(commands)):
            tg.start_soon(one, i)
            await anyio.sleep(0.1)  # the earlier command is now inside its wait (an engine exiting)
    return outcomes


async def test_an_update_racing_a_start_leaves_one_visible_engine(world: World) -> None:
    await world.fleet.apply(world.document(), activate=True)
    await world.settled()
    first = world.running_pids()
    outcomes = await at_once(
        lambda: world.fleet.apply(world.document(["--threads", "2"]), activate=True),
        lambda: world.fleet.start("m"),
    )
    await world.settled()
    assert outcomes == [None, None]
    assert world.running_pids() == world.visible_pids() and len(world.running_pids()) == 1
    assert world.running_pids().isdisjoint(first)  # the old engine is gone
    assert world.fleet.get("m").spec.engine_config.extra_args == ["--threads", "2"]


async def test_a_delete_racing_an_apply_and_a_start_leaves_no_invisible_engine(world: World) -> None:
    await world.fleet.apply(world.document(), activate=True)
    await world.settled()
    outcomes = await at_once(
        lambda: world.fleet.delete("m"),
        lambda: world.fleet.start("m"),  # waits for the delete: then there is nothing to start
        lambda: world.fleet.apply(world.document(["--threads", "3"]), activate=True),
    )
    await world.settled()
    assert isinstance(outcomes[1], DeploymentNotFound) and outcomes[0] is None and outcomes[2] is None
    assert world.running_pids() == world.visible_pids() and len(world.running_pids()) == 1
    assert world.store.get_deployment("m") is not None


async def test_two_deletes_and_an_update_at_once(world: World) -> None:
    await world.fleet.apply(world.document(), activate=True)
    await world.settled()
    outcomes = await at_once(
        lambda: world.fleet.apply(world.document(["--threads", "4"]), activate=True),
        lambda: world.fleet.delete("m"),
        lambda: world.fleet.delete("m"),
    )
    await world.settled()
    assert outcomes[0] is None and outcomes[1] is None and isinstance(outcomes[2], DeploymentNotFound)
    assert world.running_pids() == set() and world.fleet.names() == [] and world.store.get_deployment("m") is None


async def test_a_stop_then_a_start_at_once_ends_running(world: World) -> None:
    await world.fleet.apply(world.document(), activate=True)
    await world.settled()
    outcomes = await at_once(lambda: world.fleet.stop("m"), lambda: world.fleet.start("m"))
    await world.settled()
    assert outcomes == [None, None]
    controller = world.fleet.get("m")
    assert controller.desired is Desired.RUN and controller.status.state is InstanceState.READY
    assert world.running_pids() == world.visible_pids() and len(world.running_pids()) == 1
    assert world.store.get_deployment("m").operator_stopped is False  # type: ignore[union-attr]


async def test_an_operators_stop_is_kept_across_a_restart_of_capyctl(tmp_path: Path) -> None:
    w = World(tmp_path)
    async with anyio.create_task_group() as tg:
        await tg.start(w.fleet.run)
        await w.fleet.apply(w.document(), activate=True)
        await w.fleet.stop("m")
        tg.cancel_scope.cancel()
    again = World(tmp_path)
    again.store = w.store
    again.fleet._store = w.store  # the same state directory, read by a new CapyCTL
    async with anyio.create_task_group() as tg:
        await tg.start(again.fleet.run)
        with pytest.raises(DeploymentStopped):
            again.fleet.instances("m")
        tg.cancel_scope.cancel()
    assert again.processes.spawned == []


async def test_measured_start_times_are_kept_with_the_deployment(tmp_path: Path) -> None:
    w = World(tmp_path)
    w.processes.stop_takes = 0.0
    async with anyio.create_task_group() as tg:
        await tg.start(w.fleet.run)
        await w.fleet.apply(w.document(), activate=True)
        await w.settled()
        measured = w.fleet.get("m").status.cold_starts
        assert len(measured) == 1  # one start measured (instant here: the fake engine is ready at once)
        await w.fleet.apply(w.document(), activate=False)  # unchanged: what was measured stays
        tg.cancel_scope.cancel()
    assert w.store.get_deployment("m").cold_starts == measured  # type: ignore[union-attr]
    again = World(tmp_path)
    again.fleet._store = w.store  # the same state directory, read by a new CapyCTL
    async with anyio.create_task_group() as tg:
        await tg.start(again.fleet.run)
        assert again.fleet.get("m").status.cold_starts == measured
        tg.cancel_scope.cancel()


async def test_a_missing_model_is_refused_saying_what_to_set(world: World) -> None:
    gone = world.model.with_name("gone.gguf")
    with pytest.raises(InvalidConfig) as caught:
        await world.fleet.apply({**world.document(), "model": str(gone)}, activate=False)
    assert caught.value.message == (
        f"model {str(gone)!r} does not exist on this machine; set model to the path of "
        "the model file or directory for e to load"
    )
    assert list(world.fleet.controllers()) == []


async def test_a_stored_deployment_that_cannot_be_set_up_is_left_out_and_the_others_serve(tmp_path: Path) -> None:
    from capyctl.domain.deployments import Deployment
    from capyctl.services.fleet import decode_spec

    w = World(tmp_path)
    # made on a server of several machines; this CapyCTL runs alone
    w.store.put_deployment(Deployment(spec=decode_spec({"name": "far", "engine": "e", "model": "/m", "host": "gpu-a"})))
    w.store.put_deployment(Deployment(spec=decode_spec(w.document())))
    async with anyio.create_task_group() as tg:
        await tg.start(w.fleet.run)
        assert w.fleet.names() == ["m"]
        await w.fleet.start("m")
        await w.settled()
        assert w.fleet.get("m").status.state is InstanceState.READY
        tg.cancel_scope.cancel()
    unloaded = [e for e in w.store.events if e["kind"] == "deployment_unloaded"]
    assert [e["deployment"] for e in unloaded] == ["far"] and "alone" in unloaded[0]["detail"]["reason"]
