"""A fake registry of hosts for the fleet's unit tests: hosts whose state the test sets, each running the
engines the server's commands launch (a pid per launch, a probe that finds them ready, a stop that ends them).
It answers what ``Fleet`` and ``RemoteEngineEffects`` ask of ``HostRegistry``; what each host was told is in
``sent``."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import anyio

from capyctl.domain.engines import EngineFamily, EngineInstall
from capyctl.domain.errors import DeviceOffline, HostNotFound, InvalidRequest
from capyctl.domain.hosts import HostState
from capyctl.domain.link import RunningInstance

ENGINE = EngineInstall(name="e", family=EngineFamily.LLAMACPP, path="/bin/e", version="0.6.0", version_text="")


class FakeRegistry:
    def __init__(self, *hosts: str) -> None:
        self.states = {name: HostState.ONLINE for name in hosts}
        self.drained: set[str] = set()
        self.due: set[str] = set()  # hosts whose instances are to be replaced now
        self.sent: list[tuple[str, str, str, int]] = []  # (host, action, instance, generation)
        self.running: dict[tuple[str, str], tuple[int, int]] = {}  # (host, instance) -> (pid, generation)
        self.listeners: list[Callable[[str, list[RunningInstance]], None]] = []
        self._pids = itertools.count(5000)
        self.link_session = 1
        self.watchers: dict[str, list[Any]] = {}  # host -> the effects that asked for its exit news
        self.loads: dict[tuple[str, str], tuple[Any, float]] = {}  # (host, instance) -> (its load, heard at)

    # --- what the fleet asks
    def on_linked(self, told: Callable[[str, list[RunningInstance]], None]) -> None:
        self.listeners.append(told)

    def state(self, name: str) -> HostState:
        if name not in self.states:
            raise HostNotFound(name)
        return self.states[name]

    def hosts_with(self, engine: str) -> list[tuple[str, HostState]]:
        return sorted(self.states.items()) if engine == ENGINE.name else []

    def engine(self, name: str, engine: str) -> EngineInstall | None:
        self.state(name)
        return ENGINE if engine == ENGINE.name else None

    def devices(self, name: str) -> list[Any]:
        return []

    def draining(self, name: str) -> bool:
        self.state(name)
        return name in self.drained

    def drain(self, name: str, draining: bool) -> None:
        self.state(name)
        (self.drained.add if draining else self.drained.discard)(name)

    def replacement_due(self, name: str) -> bool:
        return name in self.due

    # --- what the remote effects ask
    async def run(
        self, name: str, action: str, args: dict[str, Any], instance: str = "", generation: int = 0
    ) -> dict[str, Any]:
        if self.state(name) is not HostState.ONLINE:
            raise DeviceOffline(name, self.state(name).value)
        self.sent.append((name, action, instance, generation))
        if action == "launch":
            pid = next(self._pids)
            self.running[(name, instance)] = (pid, generation)
            return {"pid": pid, "port": 7000, "log_path": f"/logs/{instance}.log", "launch_id": f"L{pid}"}
        launched = self.running.get((name, instance))
        if launched is None or launched[1] != generation:
            raise InvalidRequest(f"no launch {generation} of {instance!r} runs on this host")
        if action == "stop":
            del self.running[(name, instance)]
            return {"status": -15}
        if action == "probe":
            return {"ready": True}
        if action == "load":
            return {"running": 0, "waiting": 0}
        return {}

    async def until_online(self, name: str) -> None:
        while self.state(name) is not HostState.ONLINE:
            await anyio.sleep(0.1)

    def ingress(self, name: str) -> tuple[str, int]:
        return f"10.0.0.{sorted(self.states).index(name) + 2}", 8444

    def session(self, name: str) -> int:
        return self.link_session

    def proven(self, name: str) -> tuple[int, list[RunningInstance]] | None:
        return (self.link_session, self.hello(name))

    def exit_of(self, name: str, instance: str, pid: int) -> Any:
        return None

    def load_of(self, name: str, instance: str) -> tuple[Any, float] | None:
        return self.loads.get((name, instance))

    def watch_exits(self, name: str, watcher: Any) -> None:
        self.watchers.setdefault(name, []).append(watcher)

    def offline(self, name: str, model: str) -> DeviceOffline | None:
        state = self.state(name)
        return None if state is HostState.ONLINE else DeviceOffline(name, state.value, model=model)

    # --- what the test does
    def hello(self, name: str) -> list[RunningInstance]:
        return [
            RunningInstance(
                instance=instance,
                deployment=instance.partition("/")[0],
                number=generation,
                generation=generation,
                pid=pid,
                pid_start_time=1.0,
                port=7000,
                launch_id=f"L{pid}",
            )
            for (host, instance), (pid, generation) in sorted(self.running.items())
            if host == name
        ]

    def links(self, name: str) -> None:
        """Host ``name`` (back) online, its hello telling the fleet what runs there."""
        self.states[name] = HostState.ONLINE
        self.link_session += 1
        for told in self.listeners:
            told(name, self.hello(name))
        for watcher in self.watchers.get(name, []):  # as the registry does: its hello may end engines
            watcher.exit_news()

    def on(self, name: str) -> list[str]:
        """The instances running on host ``name``."""
        return sorted(instance for host, instance in self.running if host == name)
