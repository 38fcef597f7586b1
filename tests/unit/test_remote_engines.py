"""An engine on a host as the controller's effects (``RemoteEngineEffects``), over a fake registry of hosts, in
virtual time: what each effect asks the host, when an engine counts as gone (only on evidence), adoption
after a server's restart, and what a stopping server leaves running."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import anyio
import pytest

from capyctl.domain.engines import EngineFamily, EngineInstall
from capyctl.domain.errors import DeviceOffline, InvalidRequest
from capyctl.domain.hosts import HostState
from capyctl.domain.link import ExitCause, ProcessExit, RunningInstance
from capyctl.services.fleet import decode_spec
from capyctl.services.server_remote_engines import GONE, RemoteEngineEffects
from tests.fakes.ports import VirtualClock, virtual_time

pytestmark = pytest.mark.anyio
anyio_backend = pytest.fixture(virtual_time)
SPEC = decode_spec({"name": "chat", "engine": "vllm", "model": "/models/m", "host": "gpu-a"})
ENGINE = EngineInstall(name="vllm", family=EngineFamily.VLLM, path="/venv", version="0.32.0", version_text="")


class FakeHosts:
    """A fake ``HostLink`` (what the effects ask of the registry): one host, whose link, state and answers the
    test sets."""

    def __init__(self) -> None:
        self.state_now = HostState.ONLINE
        self.link_session = 1
        self.watchers: list[Any] = []
        self.running: list[RunningInstance] | None = []  # the hello's list; None: not linked
        self.exits: dict[tuple[str, int], ProcessExit] = {}
        self.sent: list[tuple[str, dict[str, Any], int]] = []  # (action, args, generation)
        self.answers: dict[str, dict[str, Any] | Exception] = {
            "launch": {"pid": 4242, "log_path": "/l/1.log", "launch_id": "L1"},
            "adopt": {"pid": 777, "log_path": "/l/0.log", "launch_id": "x"},
            "stop": {"status": -15},
            "probe": {"ready": True},
            "load": {"running": 0, "waiting": 0},
        }

    async def run(
        self, name: str, action: str, args: dict[str, Any], instance: str = "", generation: int = 0
    ) -> dict[str, Any]:
        assert name == "gpu-a" and instance == "chat"
        if self.state_now != HostState.ONLINE:
            raise DeviceOffline(name, self.state_now.value)
        self.sent.append((action, args, generation))
        answer = self.answers[action]
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def until_online(self, name: str) -> None:
        while self.state_now != HostState.ONLINE:
            await anyio.sleep(0.1)

    def ingress(self, name: str) -> tuple[str, int]:
        return "10.0.0.2", 8444

    def session(self, name: str) -> int:
        return self.link_session

    def proven(self, name: str) -> tuple[int, list[RunningInstance]] | None:
        return None if self.running is None else (self.link_session, self.running)

    def exit_of(self, name: str, instance: str, pid: int) -> ProcessExit | None:
        return self.exits.get((instance, pid))

    def watch_exits(self, name: str, watcher: Any) -> None:
        self.watchers.append(watcher)

    def exit(self, pid: int, code: int | None, cause: ExitCause = "exited") -> None:
        self.exits[("chat", pid)] = ProcessExit(instance="chat", pid=pid, returncode=code, at=1.0, cause=cause)

    def state(self, name: str) -> HostState:
        return self.state_now

    def offline(self, name: str, model: str) -> DeviceOffline | None:
        online = self.state_now == HostState.ONLINE
        return None if online else DeviceOffline(name, self.state_now.value, model=model)

    def actions(self) -> list[str]:
        return [action for action, _, _ in self.sent]


def effects(hosts: FakeHosts) -> RemoteEngineEffects:
    return RemoteEngineEffects(SPEC, ENGINE, "gpu-a", hosts, VirtualClock())


async def test_each_launch_has_its_own_gate_key_and_a_newer_generation() -> None:
    hosts = FakeHosts()
    remote = effects(hosts)
    first = await remote.launch(1)
    address = first.address
    url = urlsplit(address.url)
    assert (url.scheme, url.hostname, url.port, address.tls_name) == ("https", "10.0.0.2", 8444, "gpu-a")
    assert url.username is None and url.password is None  # the gate key is beside the URL, never in it
    assert first.pid == 4242 and first.log_path == "gpu-a:/l/1.log" and not first.adopted
    action, args, generation = hosts.sent[0]
    assert action == "launch" and args["gate"] == address.gate and len(address.gate or "") >= 24
    assert args["spec"]["name"] == "chat" and args["engine"]["family"] == "vllm"
    await remote.stop(first, 1.0)
    second = await remote.launch(2)
    assert second.address.gate != address.gate  # the first launch's key opens nothing now
    assert hosts.sent[-1][0] == "launch" and hosts.sent[-1][2] > generation


async def test_an_engine_a_server_before_this_one_launched_is_adopted_not_started_again() -> None:
    hosts = FakeHosts()
    hosts.running = [
        RunningInstance(
            instance="chat",
            deployment="chat",
            number=3,
            generation=555,
            pid=777,
            pid_start_time=1.0,
            port=40000,
            launch_id="x",
        )
    ]
    remote = effects(hosts)
    adopted = await remote.launch(1)
    assert adopted.adopted and adopted.pid == 777
    assert hosts.sent == [("adopt", {"gate": adopted.address.gate}, 555)]  # its own generation
    assert remote.exited(adopted) is None
    hosts.exit(777, 0)  # it ends later: the next launch is a launch, not an adoption
    assert remote.exited(adopted) == 0 and remote.ended_by(adopted) is None
    await remote.launch(2)
    assert hosts.actions() == ["adopt", "launch"]


async def test_an_engine_counts_gone_only_on_the_hosts_word() -> None:
    hosts = FakeHosts()
    remote = effects(hosts)
    engine = await remote.launch(1)
    hosts.state_now, hosts.running = HostState.LOST, None  # silent: nothing is known, nothing is released
    assert remote.exited(engine) is None
    hosts.state_now, hosts.link_session = HostState.ONLINE, 2
    hosts.running = [
        RunningInstance(
            instance="chat",
            deployment="chat",
            number=1,
            generation=1,
            pid=4242,
            pid_start_time=1.0,
            port=40000,
            launch_id="L1",
        )
    ]
    assert remote.exited(engine) is None  # back, and it says the engine still runs: kept
    hosts.link_session, hosts.running = 3, []
    assert remote.exited(engine) == GONE  # back, and it says the engine no longer runs
    assert remote.ended_by(engine) == "not_on_host"
    again = effects(hosts)
    hosts.running, hosts.link_session = [], 4
    relaunched = await again.launch(1)
    hosts.link_session = 5  # back once more: a process under the same pid, but another launch (a pid reused)
    hosts.running = [
        RunningInstance(
            instance="chat",
            deployment="chat",
            number=1,
            generation=1,
            pid=4242,
            pid_start_time=9.0,
            port=40000,
            launch_id="other",
        )
    ]
    assert again.exited(relaunched) == GONE


async def test_a_revoked_hosts_engine_counts_gone_and_a_told_exit_keeps_its_status() -> None:
    hosts = FakeHosts()
    remote = effects(hosts)
    engine = await remote.launch(1)
    assert remote.ended_by(engine) is None  # it runs
    hosts.exit(4242, 3)
    assert remote.exited(engine) == 3 and remote.ended_by(engine) is None  # by itself: a crash
    other = effects(FakeHosts())
    launched = await other.launch(1)
    other._hosts.state_now = HostState.REVOKED  # type: ignore[attr-defined]
    assert other.exited(launched) == GONE and other.ended_by(launched) == "host_revoked"
    stopped = effects(hosts := FakeHosts())
    launched = await stopped.launch(1)
    hosts.exit(4242, -15, "agent_stopped")  # its agent stopped, and told so before its link closed
    assert stopped.exited(launched) == -15 and stopped.ended_by(launched) == "agent_stopped"


async def test_a_stop_waits_for_an_offline_host_and_a_stopping_server_leaves_the_engine_running() -> None:
    hosts = FakeHosts()
    remote = effects(hosts)
    engine = await remote.launch(1)
    hosts.state_now = HostState.SUSPENDED
    async with anyio.create_task_group() as tg:
        stopped: list[int] = []

        async def stop() -> None:
            stopped.append(await remote.stop(engine, 1.0))

        tg.start_soon(stop)
        await anyio.sleep(3600)  # an hour: still held, nothing released by time
        assert stopped == [] and hosts.actions() == ["launch"]
        hosts.state_now = HostState.ONLINE
    assert stopped == [-15] and hosts.actions() == ["launch", "stop"] and remote.exited(engine) == -15

    leaving = effects(FakeHosts())
    kept = await leaving.launch(1)
    leaving.leave()
    assert await leaving.stop(kept, 1.0) == GONE
    assert leaving._hosts.actions() == ["launch"]  # type: ignore[attr-defined]  # no stop was sent
    assert leaving.exited(kept) is None  # nor is it counted gone: its cut requests stay counted


async def test_a_host_that_runs_no_such_launch_ends_it_and_offline_says_why_for_the_model() -> None:
    hosts = FakeHosts()
    remote = effects(hosts)
    engine = await remote.launch(1)
    hosts.answers["probe"] = InvalidRequest("no launch 1 of 'chat' runs on this host")
    assert not await remote.ready(engine) and remote.exited(engine) == GONE
    assert remote.offline() is None
    hosts.state_now = HostState.SUSPENDED
    refusal = remote.offline()
    assert isinstance(refusal, DeviceOffline) and refusal.extra["model"] == "chat"
    assert refusal.extra["reason"] == "suspended" and refusal.retry_after > 0
    assert await remote.load(engine) is None  # a reading that cannot be had settles nothing


async def test_an_engine_kept_while_its_host_was_away_serves_again_once_a_probe_finds_it_ready() -> None:
    hosts = FakeHosts()
    remote = effects(hosts)
    engine = await remote.launch(1)
    assert remote.offline() is None
    hosts.link_session = 2  # the host linked again, saying the engine still runs: not taken on trust all the same
    hosts.running = [
        RunningInstance(
            instance="chat",
            deployment="chat",
            number=1,
            generation=1,
            pid=4242,
            pid_start_time=1.0,
            port=40000,
            launch_id="L1",
        )
    ]
    refusal = remote.offline()
    assert isinstance(refusal, DeviceOffline) and refusal.extra["reason"] == "reconnecting"
    hosts.answers["probe"] = {"ready": False}  # not ready yet: still refused, probed again
    async with anyio.create_task_group() as tg:
        tg.start_soon(remote.reprove)
        await anyio.sleep(2)
        assert remote.offline() is not None and hosts.actions().count("probe") >= 2
        hosts.answers["probe"] = {"ready": True}
    assert remote.offline() is None and remote.exited(engine) is None  # kept, not restarted
    hosts.link_session = 3
    hosts.answers["probe"] = InvalidRequest("no launch 1 of 'chat' runs on this host")
    await remote.reprove()
    assert remote.exited(engine) == GONE and remote.offline() is None  # gone: the controller starts it again
