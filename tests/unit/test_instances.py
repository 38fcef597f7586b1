"""A deployment's instances in the fleet, with fake processes and a fake registry of hosts, in virtual time:
several instances on one machine, scaling a running deployment, placement kept across a restart, instances
without a place, and on a server of several machines: spread over hosts, a drain, the replacement of a lost
host's instance (fenced by its own instance name and generation, stopped when its host is back) and an engine
no instance knows stopped when its host links."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from capyctl.domain.config import Switching
from capyctl.domain.deployments import InstanceState
from capyctl.domain.engines import EngineFamily, EngineInstall
from capyctl.domain.errors import NotPlaced
from capyctl.domain.hosts import HostState
from capyctl.domain.memory import Device
from capyctl.domain.ports import EngineLoad
from capyctl.domain.scheduling import QueueLimits
from capyctl.services.admission import AdmissionService
from capyctl.services.controllers import ControllerSettings
from capyctl.services.events import Events
from capyctl.services.fleet import Fleet
from capyctl.services.switching import Switchboard
from tests.fakes.hosts import FakeRegistry
from tests.fakes.ports import FakeEngineAdapter, FakeProcessControl, FakeStore, VirtualClock, virtual_time

pytestmark = pytest.mark.anyio
anyio_backend = pytest.fixture(virtual_time)
SETTINGS = ControllerSettings(startup_timeout=5, stop_grace=0.1, poll_interval=0.005, max_start_failures=3)
GiB = 1 << 30


class World:
    def __init__(self, tmp_path: Path, hosts: FakeRegistry | None = None, devices: int = 0) -> None:
        self.tmp_path = tmp_path
        self.store = FakeStore()
        self.processes = FakeProcessControl()
        self.hosts = hosts
        if hosts is None:
            self.store.put_engine(
                EngineInstall(name="e", family=EngineFamily.LLAMACPP, path="/bin/e", version="0.6.0", version_text="")
            )
        self.model = tmp_path / "m.gguf"
        self.model.write_bytes(b"GGUF")
        self.clock = VirtualClock()
        self.events = Events(self.store, self.clock)
        self.devices = [Device(name=f"gpu{i}", capacity=2 * GiB) for i in range(devices)]
        self.adapter = FakeEngineAdapter()
        self.fleet = self.make_fleet()

    def make_fleet(self) -> Fleet:
        ports = itertools.count(6000)
        room = Switchboard(
            self.devices, Switching(), AdmissionService(QueueLimits(), self.clock), self.clock, self.events
        )
        fleet = Fleet(
            self.store,
            {"llamacpp": self.adapter},
            self.processes,
            self.clock,  # type: ignore[arg-type]
            self.events,
            lambda: next(ports),
            self.tmp_path / "logs",
            SETTINGS,
            room=room,
            hosts=self.hosts,  # type: ignore[arg-type]
            drain_timeout=10.0,
        )
        room.bind(fleet.managed)
        return fleet

    def document(self, instances: int, **extra: Any) -> dict[str, Any]:
        model = "/m.gguf" if self.hosts is not None else str(self.model)
        return {"name": "m", "engine": "e", "model": model, "instances": instances, **extra}

    def members(self) -> list[Any]:
        return self.fleet.get("m").members

    def kinds(self, kind: str) -> list[dict[str, Any]]:
        return [e["detail"] for e in self.store.events if e["kind"] == kind]

    async def until(self, condition: Any, what: str, limit: float = 60) -> None:
        with anyio.fail_after(limit):
            while not condition():
                await anyio.sleep(0.01)

    async def all_ready(self) -> None:
        await self.until(lambda: all(m.status.state is InstanceState.READY for m in self.members()), "ready")


@pytest.fixture
async def alone(tmp_path: Path) -> AsyncIterator[World]:
    w = World(tmp_path)
    async with anyio.create_task_group() as tg:
        await tg.start(w.fleet.run)
        yield w
        tg.cancel_scope.cancel()
    assert w.processes.running() == []


async def test_three_instances_on_one_machine_run_three_engines_each_with_its_own_logs(alone: World) -> None:
    outcome, found = await alone.fleet.apply(alone.document(3), activate=True)
    assert outcome == "created" and [m.index for m in found.members] == [0, 1, 2]
    await alone.all_ready()
    assert len(alone.processes.running()) == 3
    logs = {Path(m.status.log_path).parent for m in alone.members()}
    assert logs == {alone.tmp_path / "logs" / "m", *(alone.tmp_path / "logs" / "m" / f"instance-{i}" for i in (1, 2))}
    assert [p["instance"] for p in alone.kinds("instance_placed")] == [0, 1, 2]


async def test_each_ready_instance_of_a_model_with_several_has_its_engine_load_sampled_every_second(
    alone: World,
) -> None:
    reads: list[float] = []

    async def load(base_url: str) -> EngineLoad | None:
        reads.append(alone.clock.monotonic())
        return EngineLoad(3, 1, 0.9) if len(reads) % 2 else None  # every other read fails

    alone.adapter.load = load  # type: ignore[method-assign]
    await alone.fleet.apply(alone.document(2), activate=True)
    await alone.all_ready()
    await alone.until(lambda: len(reads) >= 4, "two rounds of reads")
    await anyio.sleep(0.1)  # (the round's reads are in)
    samples = [m.sample for m in alone.members()]
    (sampled,) = [m for m in samples if m is not None]  # the instance whose read answered; the other: unknown
    assert (sampled.running, sampled.waiting, sampled.kv_usage) == (3, 1, 0.9)
    assert alone.clock.monotonic() - sampled.at < 1.5  # fresh: taken within the last round
    await alone.fleet.apply(alone.document(1), activate=False)  # one instance: nothing to balance, no reads
    made = len(reads)
    await anyio.sleep(3)
    assert len(reads) == made


async def test_scaling_down_drains_the_highest_index_and_scaling_up_leaves_the_others_running(alone: World) -> None:
    await alone.fleet.apply(alone.document(3), activate=True)
    await alone.all_ready()
    pids = {m.index: m.status.pid for m in alone.members()}
    alone.members()[2].in_flight = 1  # a request still at instance 2
    scaling = anyio.Event()

    async def scale() -> None:
        outcome, _ = await alone.fleet.apply(alone.document(1), activate=False)
        assert outcome == "scaled"
        scaling.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(scale)
        await alone.until(lambda: alone.members()[2].draining, "instance 2 draining")
        await anyio.sleep(5)
        assert not scaling.is_set() and alone.members()[2].status.pid == pids[2]  # it waits for that request
        alone.members()[2].in_flight = 0
    assert [(m.index, m.status.pid) for m in alone.members()] == [(0, pids[0])]
    assert {p.pid for p in alone.processes.running()} == {pids[0]}
    assert [e["instance"] for e in alone.kinds("instance_removed")] == [2, 1]
    outcome, found = await alone.fleet.apply(alone.document(2), activate=True)
    assert outcome == "scaled" and [m.index for m in found.members] == [0, 1]
    await alone.all_ready()
    assert found.members[0].status.pid == pids[0] and len(alone.processes.running()) == 2


async def test_a_scale_down_that_runs_out_of_drain_time_stops_the_instance_all_the_same(alone: World) -> None:
    await alone.fleet.apply(alone.document(2), activate=True)
    await alone.all_ready()
    alone.members()[1].in_flight = 3
    began = alone.clock.monotonic()
    await alone.fleet.apply(alone.document(1), activate=False)
    assert alone.clock.monotonic() - began >= 10.0  # the drain timeout, then the stop
    assert alone.kinds("instance_removed")[-1] == {"instance": 1, "in_flight": 3}


async def test_two_devices_take_one_instance_each_and_the_places_are_kept_across_a_restart(tmp_path: Path) -> None:
    w = World(tmp_path, devices=2)
    async with anyio.create_task_group() as tg:
        await tg.start(w.fleet.run)
        await w.fleet.apply(w.document(2, resources={"memory": "1500MiB"}), activate=True)
        await w.all_ready()
        assert [(m.index, m.device) for m in w.members()] == [(0, "gpu0"), (1, "gpu1")]
        assert [sorted(w.fleet.room.charged(d).values()) for d in w.devices] == [[1500 << 20], [1500 << 20]]
        tg.cancel_scope.cancel()
    again = World(tmp_path, devices=2)
    again.store = w.store
    again.fleet = again.make_fleet()
    async with anyio.create_task_group() as tg:
        await tg.start(again.fleet.run)
        assert [(m.index, m.device) for m in again.members()] == [(0, "gpu0"), (1, "gpu1")]
        assert again.kinds("instance_placed") == w.kinds("instance_placed")  # none placed anew
        tg.cancel_scope.cancel()


async def test_an_instance_with_no_place_is_left_out_with_its_reason(alone: World) -> None:
    _, found = await alone.fleet.apply(alone.document(3, placement={"max_per_host": 2}), activate=False)
    assert [m.index for m in found.members] == [0, 1]
    assert found.unplaced == ["instance 2: no place: this machine: runs 2 instances already (placement.max_per_host)"]
    assert alone.kinds("instance_unplaced") == [{"reasons": found.unplaced}]
    assert len(alone.fleet.instances("m")) == 2  # the placed ones serve


# --- several machines -------------------------------------------------------------------------------------


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[World]:
    w = World(tmp_path, FakeRegistry("gpu-a", "gpu-b", "gpu-c"))
    async with anyio.create_task_group() as tg:
        await tg.start(w.fleet.run)
        yield w
        tg.cancel_scope.cancel()


def hosts_of(w: World) -> list[tuple[int, str | None]]:
    return [(m.index, m.host) for m in w.members()]


async def test_three_instances_spread_one_per_host_each_known_there_by_its_own_name(server: World) -> None:
    await server.fleet.apply(server.document(3), activate=True)
    await server.all_ready()
    registry = server.hosts
    assert registry is not None
    assert hosts_of(server) == [(0, "gpu-a"), (1, "gpu-b"), (2, "gpu-c")]
    assert (registry.on("gpu-a"), registry.on("gpu-b"), registry.on("gpu-c")) == (["m"], ["m/1"], ["m/2"])


async def test_a_drained_host_gets_nothing_new_its_instance_is_replaced_then_stopped(server: World) -> None:
    registry = server.hosts
    assert registry is not None
    await server.fleet.apply(server.document(3), activate=True)
    await server.all_ready()
    leaving = server.members()[1]
    leaving.in_flight = 1
    await server.fleet.drain_host("gpu-b")
    assert server.fleet.drain_state("gpu-b") == "draining"
    await server.until(
        lambda: "gpu-b" not in [m.host for m in server.members()] and server.members()[-1].ready, "a replacement"
    )
    assert hosts_of(server) == [(0, "gpu-a"), (2, "gpu-c"), (3, "gpu-a")]  # (its index 1 is held until it ends)
    assert registry.on("gpu-b") == ["m/1"]  # still finishing its request
    assert [i.index for i in server.fleet.instances("m")] == [0, 2, 3]  # no new request goes there
    leaving.in_flight = 0
    await server.until(lambda: server.fleet.drain_state("gpu-b") == "drained", "drained")
    assert registry.on("gpu-b") == [] and server.fleet.get("m").retired == []
    assert server.kinds("instance_retired")[-1] == {"instance": 1, "host": "gpu-b", "why": "drained"}
    await server.fleet.apply(server.document(4), activate=False)  # scaling up: never on the drained host
    assert "gpu-b" not in {m.host for m in server.members()}
    await server.fleet.undrain_host("gpu-b")
    assert server.fleet.drain_state("gpu-b") is None


async def test_a_lost_hosts_instance_is_replaced_and_stopped_when_its_host_returns(server: World) -> None:
    registry = server.hosts
    assert registry is not None
    await server.fleet.apply(server.document(3), activate=True)
    await server.all_ready()
    old = server.members()[2]
    old_generation = registry.running[("gpu-c", "m/2")][1]
    registry.states["gpu-c"] = HostState.LOST
    registry.due.add("gpu-c")
    await server.until(lambda: [m.host for m in server.members()].count("gpu-a") == 2, "a replacement")
    replacement = server.members()[-1]
    assert replacement.index == 3 and replacement.holder == "m/3"  # its own name: the old one's commands
    await server.until(lambda: replacement.ready, "the replacement ready")  # cannot reach it
    assert old in server.fleet.get("m").retired and old.status.pid is not None  # held: nothing proves it gone
    assert ("gpu-c", "stop", "m/2", old_generation) not in registry.sent
    registry.due.discard("gpu-c")
    registry.links("gpu-c")  # back: the old engine is stopped now
    await server.until(lambda: registry.on("gpu-c") == [], "the old engine stopped")
    assert ("gpu-c", "stop", "m/2", old_generation) in registry.sent
    await server.until(lambda: server.fleet.get("m").retired == [], "the old instance dropped")
    assert hosts_of(server) == [(0, "gpu-a"), (1, "gpu-b"), (3, "gpu-a")]


async def test_a_drain_under_way_when_the_server_restarted_goes_on(server: World) -> None:
    registry = server.hosts
    assert registry is not None
    await server.fleet.apply(server.document(3), activate=True)
    await server.all_ready()
    registry.drained.add("gpu-b")  # drained in the host's record, as a restarted server finds it: nothing moved yet
    await server.until(lambda: registry.on("gpu-b") == [], "gpu-b's instance moved off and stopped")
    assert "gpu-b" not in [m.host for m in server.members()] and len(server.members()) == 3
    assert server.kinds("instance_moving") == [{"instance": 1, "host": "gpu-b", "why": "drained"}]


async def test_an_instance_pinned_to_a_lost_host_waits_for_it_and_no_replacement_lands_on_a_host_being_left(
    server: World,
) -> None:
    registry = server.hosts
    assert registry is not None
    await server.fleet.apply({**server.document(1), "name": "pinned", "host": "gpu-c"}, activate=True)
    await server.fleet.apply(
        server.document(2, placement={"hosts": ["gpu-b", "gpu-c"], "max_per_host": 1}), activate=True
    )
    await server.until(lambda: all(m.ready for f in server.fleet.deployments() for m in f.members), "all ready")
    assert hosts_of(server) == [(0, "gpu-b"), (1, "gpu-c")]
    registry.states["gpu-c"] = HostState.LOST
    registry.due.add("gpu-c")
    await anyio.sleep(5)  # five looks at the hosts
    assert [(m.index, m.host) for m in server.fleet.get("pinned").members] == [(0, "gpu-c")]  # it waits there
    assert hosts_of(server) == [(0, "gpu-b")]  # m's gpu-c instance left, and no replacement went back there
    assert server.fleet.get("m").unplaced == [
        "instance 2: no place: host gpu-a: not in placement.hosts; "
        "host gpu-b: runs 1 instance already (placement.max_per_host); "
        "host gpu-c: its instances are being moved off it"
    ]
    assert server.kinds("instance_moving") == [{"instance": 1, "host": "gpu-c", "why": "lost"}]  # once; not pinned's


async def test_an_engine_no_instance_knows_is_stopped_when_its_host_links(server: World) -> None:
    registry = server.hosts
    assert registry is not None
    registry.running[("gpu-b", "gone/1")] = (4000, 17)  # e.g. its deployment was deleted while gpu-b was away
    registry.links("gpu-b")
    await server.until(lambda: registry.on("gpu-b") == [], "the orphan stopped")
    assert ("gpu-b", "stop", "gone/1", 17) in registry.sent
    assert server.kinds("orphan_stopped") == [{"host": "gpu-b", "instance": "gone/1", "pid": 4000}]


async def test_with_no_host_online_nothing_is_placed_and_requests_are_told_why(server: World) -> None:
    registry = server.hosts
    assert registry is not None
    for name in registry.states:
        registry.states[name] = HostState.SUSPENDED
    _, found = await server.fleet.apply(server.document(2), activate=False)
    assert found.members == [] and len(found.unplaced) == 2
    with pytest.raises(NotPlaced) as refused:
        server.fleet.instances("m")
    assert "host gpu-a: suspended, not online" in refused.value.message and refused.value.retry_after == 5
    registry.links("gpu-b")
    await server.until(lambda: len(server.members()) == 2, "placed once a host is online")
    assert hosts_of(server) == [(0, "gpu-b"), (1, "gpu-b")] and server.fleet.get("m").unplaced == []


async def test_an_engine_its_host_no_longer_runs_is_noticed_when_the_host_says_so_not_at_the_next_look(
    server: World,
) -> None:
    """A host's engines are not looked at again and again (thousands of instances would cost a core): the
    registry's news wakes the instance. Its backstop look comes every 10 s; the news must come well before."""
    registry = server.hosts
    assert registry is not None
    await server.fleet.apply(server.document(1, placement={"hosts": ["gpu-b"]}), activate=True)
    await server.all_ready()
    (member,) = server.members()
    first = member.status.pid
    await anyio.sleep(1)  # the watch settled into its wait
    del registry.running[("gpu-b", "m")]  # its agent was restarted: the engine is gone
    registry.links("gpu-b")  # its hello says so
    await server.until(lambda: member.ready and member.status.pid not in (None, first), "relaunched", limit=2)
    assert [e["cause"] for e in server.kinds("engine_ended")] == ["not_on_host"]


async def test_an_instance_on_a_host_is_sampled_from_its_hosts_report_not_by_a_command_each(server: World) -> None:
    from capyctl.domain.link import InstanceLoad

    registry = server.hosts
    assert registry is not None
    await server.fleet.apply(server.document(3), activate=True)
    await server.all_ready()
    first, second, third = server.members()
    heard = server.clock.monotonic()
    registry.loads[(first.host, first.holder)] = (InstanceLoad(instance=first.holder, running=4, waiting=2), heard)
    registry.loads[(second.host, second.holder)] = (
        InstanceLoad(instance=second.holder, running=1, waiting=0, kv_usage=0.95),
        heard,
    )
    await server.until(lambda: first.sample is not None and second.sample is not None, "sampled", limit=3)
    assert (first.sample.running, first.sample.waiting, first.sample.at) == (4, 2, heard)
    assert (second.sample.running, second.sample.kv_usage) == (1, 0.95)
    assert third.sample is None  # its host told nothing of it: unknown, never zero
    assert not [s for s in registry.sent if s[1] == "load"]  # no command per instance
    taken = first.sample
    assert (taken.in_flight, taken.left) == (0, 0)  # CapyCTL's own counts, as the report was first read
    first.left = 5  # requests that ended after: the same report keeps the counts first taken
    await anyio.sleep(2.5)
    assert first.sample is taken
