"""A host's engines, run on the server's commands: the same ``LocalEngineEffects`` a standalone server uses,
one per instance, driven over the control link instead of by a controller in this process.

Commands name the instance (``domain.deployments.instance_id``: the deployment's name for its first instance,
``<deployment>/<n>`` for the others) and the launch number as their ``generation``, so the
host's ``CommandLedger`` refuses a command about an older launch than one it has seen. A launch opens an
ingress gate for its key; a stop (or the engine's exit) closes it. ``running`` is what the hello reports,
so that a server that reconnects can adopt what runs instead of starting it again.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import anyio
import msgspec

from capyctl.domain.deployments import DeploymentSpec
from capyctl.domain.engines import EngineInstall
from capyctl.domain.errors import InvalidRequest
from capyctl.domain.lifecycle import Launched
from capyctl.domain.link import Command, InstanceLoad, LoadSample, Message, ProcessExit, RunningInstance
from capyctl.domain.ports import Clock, EngineAdapter, ProcessControl
from capyctl.services.local_engines import LocalEngineEffects

WATCH_EVERY = 0.5  # seconds between two looks for engines that exited
LOADS_EVERY = 1.0  # seconds between two reports of the engines' loads


class Gates(Protocol):
    def open_gate(self, key: str, port: int) -> None: ...
    def close_gate(self, key: str) -> None: ...


@dataclass
class _Running:
    effects: LocalEngineEffects
    launched: Launched
    gate: str
    launch_id: str
    generation: int
    started: float  # wall clock, as the hello reports it
    deployment: str
    ending: bool = False  # being stopped here: its end is told by whoever stops it, not by ``watch``


class HostEngines:
    def __init__(
        self,
        adapters: Mapping[str, EngineAdapter],
        processes: ProcessControl,
        clock: Clock,
        pick_port: Callable[[], int],
        log_root: Path,
        gates: Gates,
    ) -> None:
        self._adapters = adapters
        self._processes = processes
        self._clock = clock
        self._pick_port = pick_port
        self._log_root = log_root
        self._gates = gates
        self._running: dict[str, _Running] = {}  # instance (``instance_id``) -> its engine

    async def handle(self, command: Command) -> dict[str, Any] | None:
        """The detail of ``command``'s result, or None when it is not an engine command."""
        action, args = command.action, command.args
        if action == "launch":
            return await self._launch(command)
        if action not in ("adopt", "stop", "probe", "load", "park", "wake"):
            return None
        running = self._running.get(command.instance)
        if running is None or running.generation != command.generation:
            raise InvalidRequest(f"no launch {command.generation} of {command.instance!r} runs on this host")
        engine = running.launched
        if action == "adopt":  # a server that restarted takes the engine over: a gate key of its own
            gate = _gate_of(args)
            self._gates.close_gate(running.gate)
            self._gates.open_gate(gate, engine.port or 0)
            running.gate = gate
            return self._described(running)
        if action == "stop":
            running.ending = True  # the server learns its status from this command's result
            status = await running.effects.stop(engine, float(args.get("grace", 10.0)))
            self._gates.close_gate(running.gate)
            del self._running[command.instance]
            return {"status": status}
        if action == "probe":
            exited = running.effects.exited(engine)
            ready = exited is None and await running.effects.ready(engine)
            return {"ready": ready, "exited": exited, "parked": await running.effects.parked(engine) if ready else None}
        if action == "load":
            load = await running.effects.load(engine)
            if load is None:
                return {"running": None, "waiting": None}
            return {"running": load.running, "waiting": load.waiting, "kv_usage": load.kv_usage}
        if action == "park":
            await running.effects.park(engine)
        else:
            await running.effects.wake(engine)
        return {}

    async def _launch(self, command: Command) -> dict[str, Any]:
        args = command.args
        try:
            spec = msgspec.convert(args.get("spec"), DeploymentSpec)
            engine = msgspec.convert(args.get("engine"), EngineInstall)
        except msgspec.ValidationError as exc:
            raise InvalidRequest(f"the launch names no usable deployment or engine: {exc}") from exc
        if spec.model:  # a path on this host, as its operator wrote it ("~" is this host's home)
            spec = msgspec.structs.replace(spec, model=str(Path(spec.model).expanduser()))
        gate = _gate_of(args)
        adapter = self._adapters.get(str(engine.family))
        if adapter is None:
            raise InvalidRequest(f"this host has no adapter for engine family {engine.family!r}")
        before = self._running.get(command.instance)
        if before is not None and before.effects.exited(before.launched) is None:
            raise InvalidRequest(f"{command.instance!r} runs launch {before.generation} here; stop it first")
        _, slash, index = command.instance.partition("/")
        if command.instance != spec.name and not (
            command.instance.startswith(spec.name + "/") and index.isdigit() and index.isascii()
        ):
            raise InvalidRequest(f"instance {command.instance!r} is not one of deployment {spec.name!r}'s")
        log_dir = self._log_root / spec.name / (f"instance-{index}" if slash else "")
        log_dir.mkdir(parents=True, exist_ok=True)
        effects = LocalEngineEffects(spec, engine, adapter, self._processes, self._clock, self._pick_port, log_dir)
        launched = await effects.launch(command.generation)
        self._gates.open_gate(gate, launched.port or 0)
        running = self._running[command.instance] = _Running(
            effects, launched, gate, uuid.uuid4().hex, command.generation, self._clock.wall(), spec.name
        )
        return self._described(running)

    @staticmethod
    def _described(running: _Running) -> dict[str, Any]:
        engine = running.launched
        return {"pid": engine.pid, "port": engine.port, "log_path": engine.log_path, "launch_id": running.launch_id}

    def running(self) -> list[RunningInstance]:
        return [
            RunningInstance(
                instance=name,
                deployment=r.deployment,
                number=r.generation,
                generation=r.generation,
                pid=r.launched.pid or 0,
                pid_start_time=r.started,
                port=r.launched.port or 0,
                launch_id=r.launch_id,
            )
            for name, r in sorted(self._running.items())
        ]

    async def watch(self, tell: Callable[[Message], Awaitable[None]]) -> None:
        """Tells the server of each engine that exited (its gate closed first); never returns."""
        while True:
            for name, running in list(self._running.items()):
                status = running.effects.exited(running.launched)
                if status is not None and not running.ending:
                    self._gates.close_gate(running.gate)
                    del self._running[name]
                    await tell(
                        ProcessExit(
                            instance=name, pid=running.launched.pid or 0, returncode=status, at=self._clock.wall()
                        )
                    )
            await anyio.sleep(WATCH_EVERY)

    async def report_loads(self, tell: Callable[[Message], Awaitable[None]]) -> None:
        """Every ``LOADS_EVERY`` seconds, each engine's load read at once and all told in one ``LoadSample``
        (one message a second, however many engines: what the server balances on); never returns."""
        while True:
            await anyio.sleep(LOADS_EVERY)
            running = [(name, r) for name, r in self._running.items() if not r.ending]
            if not running:
                continue
            loads: list[InstanceLoad] = []
            async with anyio.create_task_group() as reads:  # side by side: one slow engine delays no other
                for name, each in running:
                    reads.start_soon(self._read_load, name, each, loads)
            await tell(LoadSample(at=self._clock.wall(), loads=sorted(loads, key=lambda load: load.instance)))

    @staticmethod
    async def _read_load(name: str, running: _Running, into: list[InstanceLoad]) -> None:
        """``name``'s load added to ``into``; nothing when the read fails or takes longer than a report's
        interval (an unknown load)."""
        with anyio.move_on_after(LOADS_EVERY):
            try:
                load = await running.effects.load(running.launched)
            except Exception:  # a read that fails is an unknown load, not a fault of the host's
                return
            if load is not None:
                into.append(
                    InstanceLoad(instance=name, running=load.running, waiting=load.waiting, kv_usage=load.kv_usage)
                )

    async def stop_all(self, tell: Callable[[Message], Awaitable[None]] | None = None, grace: float = 10.0) -> None:
        """Every engine ended, each end told (cause ``agent_stopped``) while the link is up: the agent is
        stopping, and its engines do not outlive it."""

        async def end(name: str, running: _Running) -> None:
            status = await running.effects.stop(running.launched, grace)
            self._gates.close_gate(running.gate)
            self._running.pop(name, None)
            if tell is not None:
                await tell(
                    ProcessExit(
                        instance=name,
                        pid=running.launched.pid or 0,
                        returncode=status,
                        at=self._clock.wall(),
                        cause="agent_stopped",
                    )
                )

        async with anyio.create_task_group() as ending:  # side by side: each has its own grace, not the sum
            for name, running in list(self._running.items()):
                running.ending = True
                ending.start_soon(end, name, running)


def _gate_of(args: Mapping[str, Any]) -> str:
    gate = args.get("gate")
    if not isinstance(gate, str) or len(gate) < 16:
        raise InvalidRequest("a launch or an adoption needs its gate key (at least 16 characters)")
    return gate
