"""The server's registry of hosts, on fakes: invitations spent once, joins, admission, states as time
passes (told as events), revocation."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from capyctl.domain.errors import AlreadyExists, DeviceOffline, HostAnswerInvalid, HostNotFound, HostRevoked
from capyctl.domain.hosts import HostState, LinkTimings
from capyctl.domain.joining import JoinRefused
from capyctl.domain.link import CommandResult, DeviceReport, Goodbye, Hello, Inventory, ProcessExit
from capyctl.services.events import Events
from capyctl.services.server_hosts import HostRegistry
from tests.fakes.ports import FakeClock, FakeStore

SECRET = bytes(range(32))


def registry() -> tuple[HostRegistry, FakeStore, FakeClock]:
    store, clock = FakeStore(), FakeClock()
    return HostRegistry(store, clock, Events(store, clock), LinkTimings(suspend_after=5, lost_after=30)), store, clock


def hello(name: str) -> Hello:
    return Hello(host=name, version="0.1.0", protocol=1)


def states(store: FakeStore) -> list[tuple[str, Any]]:
    return [(e["detail"]["host"], e["detail"]["state"]) for e in store.events if e["kind"] == "host_state"]


def test_an_invitation_is_kept_as_a_hash_and_spent_once() -> None:
    hosts, store, clock = registry()
    invite = hosts.invite("gpu-a", SECRET, ttl=60)
    assert SECRET.hex() not in repr(store.invites) and invite.secret_hash in store.invites
    with pytest.raises(JoinRefused) as wrong:
        hosts.redeem("gpu-b", SECRET)
    assert wrong.value.reason == "wrong_host"
    hosts.redeem("gpu-a", SECRET)
    with pytest.raises(JoinRefused) as again:
        hosts.redeem("gpu-a", SECRET)
    assert again.value.reason == "used"
    hosts.invite("gpu-b", bytes(32), ttl=60)
    clock.now += 61
    with pytest.raises(JoinRefused) as late:
        hosts.redeem("gpu-b", bytes(32))
    assert late.value.reason == "expired"


def test_a_joined_host_is_admitted_with_its_certificate_only_and_a_new_join_retires_the_old_one() -> None:
    hosts, store, _ = registry()
    hosts.joined("gpu-a", "fp1")
    hosts.admit("gpu-a", "fp1")
    with pytest.raises(HostRevoked):
        hosts.admit("gpu-a", "fp-other")
    with pytest.raises(HostRevoked):
        hosts.admit("gpu-z", "fp1")  # never joined
    hosts.joined("gpu-a", "fp2")  # joined again with a new invitation
    hosts.admit("gpu-a", "fp2")
    with pytest.raises(HostRevoked):
        hosts.admit("gpu-a", "fp1")
    assert store.hosts["gpu-a"].revoked == ["fp1"]


async def test_states_follow_the_silence_and_are_told_once_each() -> None:
    hosts, store, clock = registry()
    hosts.joined("gpu-a", "fp1")
    clock.now += 100
    assert hosts.state("gpu-a") == HostState.JOINED  # never linked: joined, however long ago, never lost
    session, replaced = hosts.connected("gpu-a", "10.0.0.2", hello("gpu-a"), close=_no_close)
    assert replaced is None
    assert hosts.state("gpu-a") == HostState.ONLINE
    clock.now += 4.9
    hosts.heard("gpu-a", session, Inventory(devices=[DeviceReport(name="gpu0", capacity=8 << 30, reserve=0)]))
    clock.now += 4.9
    assert hosts.state("gpu-a") == HostState.ONLINE  # heard 4.9 s ago
    clock.now += 0.1
    assert hosts.state("gpu-a") == HostState.SUSPENDED
    clock.now += 25
    assert hosts.state("gpu-a") == HostState.LOST
    hosts.heard("gpu-a", session, Inventory())
    assert hosts.state("gpu-a") == HostState.ONLINE
    assert states(store) == [("gpu-a", "online")]  # told when it changed, not at every message
    assert store.hosts["gpu-a"].linked_at is not None  # kept: a server started later knows it linked once
    view = hosts.view("gpu-a")
    assert (view["state"], view["address"], view["version"], view["connected"]) == ("online", "10.0.0.2", "0.1.0", True)


async def test_the_watch_tells_each_change_as_time_passes() -> None:
    hosts, store, clock = registry()
    hosts.joined("gpu-a", "fp1")
    hosts.connected("gpu-a", "10.0.0.2", hello("gpu-a"), close=_no_close)

    async def told(state: str) -> None:
        with anyio.fail_after(10):
            while ("gpu-a", state) not in states(store):
                await anyio.sleep(0.01)

    async with anyio.create_task_group() as tasks:
        await tasks.start(hosts.watch)
        clock.now += 5
        await told("suspended")
        clock.now += 25
        await told("lost")
        tasks.cancel_scope.cancel()
    assert states(store) == [("gpu-a", "online"), ("gpu-a", "suspended"), ("gpu-a", "lost")]
    befores = [e["detail"]["before"] for e in store.events if e["kind"] == "host_state"]
    assert befores == [None, "online", "suspended"]


async def test_a_closed_link_is_known_at_once_and_a_goodbye_takes_the_host_out_before_it_closes() -> None:
    hosts, store, clock = registry()
    hosts.joined("gpu-a", "fp1")
    session, _ = hosts.connected("gpu-a", "10.0.0.2", hello("gpu-a"), close=_no_close)
    hosts.heard("gpu-a", session, Goodbye(code="agent_stopping", message="stopping"))  # the agent stops
    assert hosts.state("gpu-a") == HostState.DISCONNECTED  # at once: nothing new goes there
    refusal = hosts.offline("gpu-a", "chat")
    assert refusal is not None and refusal.extra["reason"] == "disconnected" and refusal.retry_after == 1
    with pytest.raises(DeviceOffline):
        await hosts.command("gpu-a", "probe", {})
    hosts.heard("gpu-a", session, ProcessExit(instance="chat", pid=7, returncode=0, at=1.0, cause="agent_stopped"))
    told = hosts.exit_of("gpu-a", "chat", 7)  # its last words on the link still count
    assert told is not None and told.cause == "agent_stopped"
    hosts.disconnected("gpu-a", session, "closed by the host")
    assert states(store)[-1] == ("gpu-a", "disconnected")  # told at the close, not at the watch's next look
    clock.now += 29.9
    assert hosts.state("gpu-a") == HostState.DISCONNECTED
    clock.now += 0.1
    assert hosts.state("gpu-a") == HostState.LOST
    again, _ = hosts.connected("gpu-a", "10.0.0.2", hello("gpu-a"), close=_no_close)  # its agent back
    assert hosts.state("gpu-a") == HostState.ONLINE
    hosts.disconnected("gpu-a", again, "connection reset")  # killed: the link reset
    assert hosts.state("gpu-a") == HostState.DISCONNECTED


async def test_a_restarted_server_counts_silence_from_its_start_and_knows_who_never_linked() -> None:
    hosts, store, clock = registry()
    hosts.joined("gpu-a", "fp1")
    hosts.joined("gpu-b", "fp2")
    hosts.connected("gpu-a", "10.0.0.2", hello("gpu-a"), close=_no_close)
    clock.now += 1000
    restarted = HostRegistry(store, clock, Events(store, clock), LinkTimings(suspend_after=5, lost_after=30))
    assert restarted.state("gpu-a") == HostState.DISCONNECTED  # not lost: silent only since this start
    assert restarted.state("gpu-b") == HostState.JOINED  # never ran `capyctl start host`
    clock.now += 29.9
    assert restarted.state("gpu-a") == HostState.DISCONNECTED
    clock.now += 0.1
    assert restarted.state("gpu-a") == HostState.LOST
    assert restarted.state("gpu-b") == HostState.JOINED


def test_the_pinned_fingerprint_is_the_current_certificates_and_none_once_revoked() -> None:
    hosts, _, _ = registry()
    assert hosts.fingerprint("gpu-a") is None  # unknown
    hosts.joined("gpu-a", "fp1")
    assert hosts.fingerprint("gpu-a") == "fp1"
    hosts.joined("gpu-a", "fp2")  # joined again: the old certificate is not it any more
    assert hosts.fingerprint("gpu-a") == "fp2"


async def test_a_revoked_host_pins_nothing() -> None:
    hosts, _, _ = registry()
    hosts.joined("gpu-a", "fp1")
    await hosts.revoke("gpu-a")
    assert hosts.fingerprint("gpu-a") is None


async def test_a_replaced_link_cannot_speak_for_the_host() -> None:
    hosts, _, clock = registry()
    hosts.joined("gpu-a", "fp1")
    old, _ = hosts.connected("gpu-a", "10.0.0.2", hello("gpu-a"), close=_first_close)
    new, replaced = hosts.connected("gpu-a", "10.0.0.3", hello("gpu-a"), close=_no_close)
    assert replaced is _first_close  # the listener closes the old link
    clock.now += 6
    hosts.heard("gpu-a", old, Inventory())  # the dead link's late message
    assert hosts.state("gpu-a") == HostState.SUSPENDED
    hosts.disconnected("gpu-a", old, "gone")
    assert hosts.view("gpu-a")["connected"] is True  # the new link is still up
    hosts.heard("gpu-a", new, Inventory())
    assert hosts.state("gpu-a") == HostState.ONLINE


async def test_revoking_closes_the_link_and_refuses_the_certificate_for_ever() -> None:
    hosts, store, _ = registry()
    closed: list[str] = []

    async def close(why: str) -> None:
        closed.append(why)

    hosts.joined("gpu-a", "fp1")
    hosts.connected("gpu-a", "10.0.0.2", hello("gpu-a"), close=close)
    await hosts.revoke("gpu-a")
    assert closed == ["host_revoked"]
    assert hosts.state("gpu-a") == HostState.REVOKED
    with pytest.raises(HostRevoked):
        hosts.admit("gpu-a", "fp1")
    assert "host_revoked" in store.kinds()
    assert ("gpu-a", "revoked") in states(store)
    with pytest.raises(HostNotFound):
        await hosts.revoke("gpu-q")
    # a registry started again from the store still refuses it
    again = HostRegistry(store, FakeClock(), Events(store, FakeClock()))
    with pytest.raises(HostRevoked):
        again.admit("gpu-a", "fp1")


async def _no_close(why: str) -> None:
    raise AssertionError(f"the link was closed ({why})")


async def _first_close(why: str) -> None:
    raise AssertionError("the registry itself never closes a replaced link")


async def test_a_command_gets_the_hosts_result_or_device_offline() -> None:
    hosts, store, clock = registry()
    hosts.joined("gpu-a", "fp1")
    sent: list[Any] = []
    session = 0

    async def answer(message: Any) -> None:  # the host answers at once
        sent.append(message)
        hosts.heard(
            "gpu-a",
            session,
            CommandResult(
                id=message.id,
                generation=message.generation,
                ok=True,
                detail={
                    "name": "llama",
                    "family": "llamacpp",
                    "path": "/opt/llama-server",
                    "version": "b1",
                    "version_text": "version: b1",
                }
                if message.args["path"] != "/bad"
                else {"name": 3},
            ),
        )

    with pytest.raises(DeviceOffline, match="joined"):  # never linked
        await hosts.command("gpu-a", "probe", {})
    closed: list[str] = []

    async def close(why: str) -> None:
        closed.append(why)

    session, _ = hosts.connected("gpu-a", "10.0.0.2", hello("gpu-a"), close=close, send=answer)
    install = await hosts.add_engine("gpu-a", "/opt/llama-server", None, None)
    assert (install.name, install.version) == ("llama", "b1")
    assert sent[0].action == "inspect_engine" and sent[0].args["path"] == "/opt/llama-server"
    assert [e.name for e in store.hosts["gpu-a"].engines] == ["llama"]
    with pytest.raises(AlreadyExists):
        await hosts.add_engine("gpu-a", "/opt/llama-server", None, None)
    with pytest.raises(HostAnswerInvalid, match="cannot read"):  # a host's answer out of shape registers nothing
        await hosts.add_engine("gpu-a", "/bad", None, None)
    assert len(store.hosts["gpu-a"].engines) == 1
    await hosts.revoke("gpu-a")
    assert closed == ["host_revoked"]
    assert [e.name for e in store.hosts["gpu-a"].engines] == ["llama"]  # the record keeps what it had


async def test_a_command_fails_when_the_link_closes_or_the_host_is_silent() -> None:
    hosts, _, clock = registry()
    hosts.joined("gpu-a", "fp1")

    async def nothing(message: Any) -> None:
        pass

    session, _ = hosts.connected("gpu-a", "10.0.0.2", hello("gpu-a"), close=_no_close, send=nothing)
    with pytest.raises(DeviceOffline, match="not answering"):
        await hosts.command("gpu-a", "probe", {}, timeout=0.05)
    async with anyio.create_task_group() as tasks:

        async def cut() -> None:
            while not hosts._waiting:  # noqa: SLF001 - the command is in flight
                await anyio.sleep(0.001)
            hosts.disconnected("gpu-a", session, "gone")

        tasks.start_soon(cut)
        with pytest.raises(DeviceOffline):
            await hosts.command("gpu-a", "probe", {}, timeout=30)
    with pytest.raises(DeviceOffline, match="disconnected"):  # its link closed: said at once
        await hosts.command("gpu-a", "probe", {})
    hosts.connected("gpu-a", "10.0.0.2", hello("gpu-a"), close=_no_close, send=nothing)
    clock.now += 6
    with pytest.raises(DeviceOffline, match="suspended"):
        await hosts.command("gpu-a", "probe", {})


async def test_each_link_that_comes_up_is_told_with_what_runs_on_the_host() -> None:
    from capyctl.domain.link import DeviceReport, Inventory, RunningInstance

    hosts, _, _ = registry()
    hosts.joined("gpu-a", "f1")
    told: list[tuple[str, list[str]]] = []
    hosts.on_linked(lambda name, running: told.append((name, [r.instance for r in running])))
    running = [
        RunningInstance(
            instance="chat",
            deployment="chat",
            number=1,
            generation=7,
            pid=42,
            pid_start_time=1.0,
            port=40000,
            launch_id="L",
        )
    ]
    session, _ = hosts.connected(
        "gpu-a", "10.0.0.2", Hello(host="gpu-a", version="0", protocol=1, running=running), close=_no_close
    )
    assert told == [] and hosts.devices("gpu-a") == []  # its devices are not known yet: nothing to charge on
    inventory = Inventory(devices=[DeviceReport(name="gpu0", capacity=10, reserve=1)])
    hosts.heard("gpu-a", session, inventory)
    assert told == [("gpu-a", ["chat"])] and [d.name for d in hosts.devices("gpu-a")] == ["gpu0"]
    hosts.heard("gpu-a", session, inventory)  # told once per link
    assert told == [("gpu-a", ["chat"])] and hosts.proven("gpu-a") == (session, running)


async def test_what_may_end_an_engine_is_news_to_the_effects_watching_that_host_only() -> None:
    import gc

    hosts, _, _ = registry()
    hosts.joined("gpu-a", "f1")
    hosts.joined("gpu-b", "f2")

    class Watcher:
        def __init__(self) -> None:
            self.news = 0

        def exit_news(self) -> None:
            self.news += 1

    on_a, on_b, gone = Watcher(), Watcher(), Watcher()
    hosts.watch_exits("gpu-a", on_a)
    hosts.watch_exits("gpu-b", on_b)
    hosts.watch_exits("gpu-a", gone)
    session, _ = hosts.connected("gpu-a", "10.0.0.2", hello("gpu-a"), close=_no_close)  # its hello: what runs
    assert (on_a.news, on_b.news, gone.news) == (1, 0, 1)
    del gone
    gc.collect()  # held weakly: a deployment deleted, its effects hear nothing more
    hosts.heard("gpu-a", session, Inventory())  # a heartbeat's worth of news: none about its engines
    assert on_a.news == 1
    hosts.heard("gpu-a", session, ProcessExit(instance="chat", pid=42, returncode=0, at=1.0))
    assert (on_a.news, on_b.news) == (2, 0)
    await hosts.revoke("gpu-b")  # its agent ends its engines
    assert (on_a.news, on_b.news) == (2, 1)
