"""A deployment's engine on a host: ``EngineEffects`` over the control link (``HostRegistry``).

The same controller that runs a local child process drives this one; each
effect is a command to the host, which runs the engine with the very
``LocalEngineEffects`` a standalone server uses (``services/host_engines``).

- A launch gets a gate key of its own; its address is the host's ingress,
  ``https://<address>:<port>``, with the host's name and the gate key beside
  the URL (``EngineAddress``: the engine session checks the ingress's
  certificate under the name and sends the key with each request). Its
  generation is a wall-clock count, so that it is newer than any launch a
  server before a restart sent to the same host.
- A host that is not online takes no request (``offline``) and no launch
  (a launch waits for it); its engine is not counted gone for that. It is
  gone only on evidence: the host told its exit, said on its return that it
  no longer runs, or answered a stop; or the host was revoked (its agent
  ends its engines).
- When the server itself stops (``leave``) its engines on hosts are left
  running; the server that starts next adopts them (``adopt``: a new gate
  key for the same process) instead of launching them again.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import msgspec

from capyctl.domain.deployments import FIRST_INSTANCE, DeploymentSpec, instance_id
from capyctl.domain.engines import EngineInstall
from capyctl.domain.errors import CapyError, DeviceOffline
from capyctl.domain.hosts import HostState
from capyctl.domain.lifecycle import EngineAddress, Launched
from capyctl.domain.link import Action, ProcessExit, RunningInstance
from capyctl.domain.ports import Clock, EngineEffects, EngineLoad

Canary = Callable[[EngineAddress, str], Awaitable[str]]  # (engine address, served model) -> its answer
GONE = -1  # the exit status of an engine known gone without one (its host said it no longer runs)
RETRY_EVERY = 0.5  # seconds between two tries of a stop while the host is out of reach
NOT_READY_PAUSE = 0.1  # seconds a probe that found the engine not ready yet waits: each probe is a round trip


class ExitWatcher(Protocol):
    def exit_news(self) -> None:
        """What the host said may end an engine: ``exited`` is worth reading again."""


class HostLink(Protocol):
    """What a deployment's engine effects on a host ask of the server's registry of hosts (``HostRegistry``):
    commands over the host's control link, and what the link knows of the host and its engines."""

    async def run(
        self, name: str, action: Action, args: dict[str, Any], instance: str = "", generation: int = 0
    ) -> dict[str, Any]:
        """A command to host ``name`` and the detail of its result; raises the host's refusal."""

    async def until_online(self, name: str) -> None:
        """Returns once the host is online and linked."""

    def ingress(self, name: str) -> tuple[str, int]:
        """Where the host's ingress answers (its address on the link, its port); raises DeviceOffline."""

    def offline(self, name: str, model: str) -> DeviceOffline | None:
        """Why a request for ``model`` cannot go to the host now; None while it is online."""

    def proven(self, name: str) -> tuple[int, list[RunningInstance]] | None:
        """(the link's session, what the host's hello said runs there) while it is linked."""

    def session(self, name: str) -> int:
        """The current link's session number (0: never linked since the server started)."""

    def exit_of(self, name: str, instance: str, pid: int) -> ProcessExit | None:
        """What the host told of the end of ``instance``'s process ``pid``; None if it told nothing."""

    def watch_exits(self, name: str, watcher: ExitWatcher) -> None:
        """``watcher.exit_news()`` each time host ``name`` tells an engine's end, links (its hello says what
        runs there) or is revoked, for as long as ``watcher`` lives (it is held weakly)."""

    def state(self, name: str) -> HostState: ...


@dataclass
class _Launch:
    generation: int
    session: int  # the link's session when it was launched or adopted
    pid: int
    launch_id: str  # the host's own name for this launch: with the pid, what proves it is the same process
    code: int | None = None  # its exit status, once known
    cause: str | None = None  # why it ended, when not by itself (see ``EngineEffects.ended_by``)

    def gone(self, cause: str) -> None:
        """Known gone without an exit status of its own (the host's word, or its revocation)."""
        if self.code is None:
            self.code, self.cause = GONE, cause


class RemoteEngineEffects(EngineEffects):
    def __init__(
        self,
        spec: DeploymentSpec,
        engine: EngineInstall,
        host: str,
        hosts: HostLink,
        clock: Clock,
        canary: Canary | None = None,
        index: int = FIRST_INSTANCE,
    ) -> None:
        self._spec = spec
        self._index = index
        self._engine = engine
        self._host = host
        self._hosts = hosts
        self._clock = clock
        self._canary = canary
        self._launches: dict[int, _Launch] = {}
        self._current: _Launch | None = None  # the latest launch
        self._proven = 0  # the link session in which the latest launch was last seen ready
        self._generation = 0
        self._leaving = False
        self._told: Callable[[], None] | None = None  # (``watch_exits``)

    @property
    def host(self) -> str:
        return self._host

    @property
    def _instance(self) -> str:
        return instance_id(self._spec.name, self._index)

    async def _run(self, action: Action, launch: _Launch | None, **args: Any) -> dict[str, Any]:
        generation = launch.generation if launch is not None else self._generation
        return await self._hosts.run(self._host, action, args, instance=self._instance, generation=generation)

    async def launch(self, number: int) -> Launched:
        await self._hosts.until_online(self._host)
        gate = secrets.token_urlsafe(24)
        running = self._adoptable() if not self._launches else None
        if running is not None:  # what a server before this one launched: taken over, not started again
            self._generation = running.generation
            detail = await self._run("adopt", None, gate=gate)
        else:
            self._generation = max(int(self._clock.wall() * 1000), self._generation + 1)
            detail = await self._run(
                "launch",
                None,
                gate=gate,
                spec=msgspec.to_builtins(self._spec),
                engine=msgspec.to_builtins(self._engine),
            )
        address, port = self._hosts.ingress(self._host)
        pid = int(detail.get("pid") or 0)
        self._launches[number] = self._current = _Launch(
            self._generation, self._hosts.session(self._host), pid, str(detail.get("launch_id") or "")
        )
        self._proven = self._current.session
        engine_port = detail.get("port")
        return Launched(
            number=number,
            address=EngineAddress(f"https://{address}:{port}", tls_name=self._host, gate=gate),
            pid=pid,
            port=int(engine_port) if engine_port else None,
            ingress_port=port,
            log_path=f"{self._host}:{detail.get('log_path')}",
            adopted=running is not None,
        )

    def _adoptable(self) -> RunningInstance | None:
        proof = self._hosts.proven(self._host)
        return next((r for r in proof[1] if r.instance == self._instance), None) if proof is not None else None

    def watch_exits(self, told: Callable[[], None]) -> bool:
        """(see ``EngineEffects``): what ``exited`` reads is the host's word, each piece of it told."""
        self._told = told
        self._hosts.watch_exits(self._host, self)
        return True

    def exit_news(self) -> None:
        """(``ExitWatcher``): the host said something that may end this instance's engine."""
        if self._told is not None:
            self._told()

    def exited(self, engine: Launched) -> int | None:
        launch = self._launches[engine.number]
        if launch.code is None and (told := self._hosts.exit_of(self._host, self._instance, launch.pid)) is not None:
            launch.code = told.returncode if told.returncode is not None else GONE
            launch.cause = "agent_stopped" if told.cause == "agent_stopped" else None
        if launch.code is None and self._hosts.state(self._host) == HostState.REVOKED:
            launch.gone("host_revoked")  # its agent is cut off and ends its engines; nothing more will be heard
        proof = self._hosts.proven(self._host) if launch.code is None else None
        if (
            proof is not None
            and proof[0] > launch.session
            and not any(
                r.instance == self._instance and r.pid == launch.pid and r.launch_id == launch.launch_id
                for r in proof[1]
            )
        ):
            launch.gone("not_on_host")  # the host came back and said it no longer runs (a reused pid is not it)
        return launch.code

    def ended_by(self, engine: Launched) -> str | None:
        return self._launches[engine.number].cause if self.exited(engine) is not None else None

    async def ready(self, engine: Launched) -> bool:
        launch = self._launches[engine.number]
        ready = await self._ready_now(launch)
        if ready is False and launch.code is None:
            await anyio.sleep(NOT_READY_PAUSE)
        return bool(ready)

    async def _ready_now(self, launch: _Launch) -> bool | None:
        """Whether the host finds ``launch`` ready now (then proved on the current link); None when the host
        is out of reach. A launch the host no longer runs, or that exited, gets its exit status."""
        session = self._hosts.session(self._host)
        try:
            detail = await self._run("probe", launch)
        except DeviceOffline:
            return None
        except CapyError:  # the host runs no such launch
            launch.gone("not_on_host")
            return False
        if detail.get("exited") is not None:
            launch.code = int(detail["exited"])
        if not detail.get("ready"):
            return False
        self._proven = max(self._proven, session)
        return True

    async def stop(self, engine: Launched, grace: float) -> int:
        launch = self._launches[engine.number]
        while self.exited(engine) is None:
            if self._leaving:
                return GONE  # the server stops, the engine goes on: the next server adopts it
            try:
                detail = await self._run("stop", launch, grace=grace)
            except DeviceOffline:  # held (memory, cut requests) until the host is back and says
                await anyio.sleep(RETRY_EVERY)
                continue
            except CapyError:  # the host runs no such launch: it is gone
                launch.gone("not_on_host")
                break
            launch.code = int(detail.get("status", GONE))
        return launch.code if launch.code is not None else GONE

    async def park(self, engine: Launched) -> None:
        await self._run("park", self._launches[engine.number])

    async def wake(self, engine: Launched) -> None:
        await self._run("wake", self._launches[engine.number])

    async def parked(self, engine: Launched) -> bool | None:
        try:
            detail = await self._run("probe", self._launches[engine.number])
        except DeviceOffline:
            return None
        parked = detail.get("parked")
        return None if parked is None else bool(parked)

    async def canary(self, engine: Launched) -> str | None:
        if self._canary is None:
            return None
        return await self._canary(engine.address, self._spec.served_model)

    async def load(self, engine: Launched) -> EngineLoad | None:
        try:
            detail = await self._run("load", self._launches[engine.number])
        except CapyError:
            return None
        running, waiting, kv = detail.get("running"), detail.get("waiting"), detail.get("kv_usage")
        if running is None or waiting is None:
            return None
        return EngineLoad(int(running), int(waiting), float(kv) if isinstance(kv, int | float) else None)

    def offline(self) -> CapyError | None:
        refusal = self._hosts.offline(self._host, self._spec.name)
        launch = self._current
        if (
            refusal is None
            and launch is not None
            and launch.code is None
            and self._proven < self._hosts.session(self._host)
        ):
            return DeviceOffline(self._host, "reconnecting", model=self._spec.name, retry_after=1)  # until reproved
        return refusal

    async def reprove(self, attempts: int = 20) -> None:
        """The host linked again: its engine serves again once it answers a probe as ready on this link (it
        was kept, not restarted); one that is no longer there counts as gone."""
        launch = self._current
        for _ in range(attempts):
            if launch is None or launch.code is not None or self._proven >= self._hosts.session(self._host):
                return
            if await self._ready_now(launch) is not False or launch.code is not None:
                return  # ready, gone, or away again (proved on its next return)
            await anyio.sleep(RETRY_EVERY)

    def leave(self) -> None:
        """The server stops: its engines on hosts are left running, for the next server to adopt."""
        self._leaving = True
