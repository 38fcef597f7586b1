"""A deployment's engines as child processes of CapyCTL on this machine: ``EngineEffects`` over the
``ProcessControl`` and ``EngineAdapter`` ports.

Each launch gets a free port on the loopback and a log file of its own
(``<log_dir>/<wall ms>-<launch>.log``); the engine's environment is the
deployment's variables, then what the engine's adapter forces or removes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

from capyctl.domain.deployments import DeploymentSpec
from capyctl.domain.engines import EngineInstall
from capyctl.domain.errors import CapyError
from capyctl.domain.lifecycle import EngineAddress, Launched
from capyctl.domain.ports import Clock, EngineAdapter, EngineEffects, EngineLoad, ProcessControl, ProcessHandle

Canary = Callable[[EngineAddress, str], Awaitable[str]]  # (engine address, served model) -> its answer


class LocalEngineEffects(EngineEffects):
    def __init__(
        self,
        spec: DeploymentSpec,
        engine: EngineInstall,
        adapter: EngineAdapter,
        processes: ProcessControl,
        clock: Clock,
        pick_port: Callable[[], int],
        log_dir: Path,
        canary: Canary | None = None,
    ) -> None:
        self._spec = spec
        self._engine = engine
        self._adapter = adapter
        self._processes = processes
        self._clock = clock
        self._pick_port = pick_port
        self._log_dir = log_dir
        self._canary = canary
        self._handles: dict[int, ProcessHandle] = {}  # launch number -> its process, while it may run

    async def launch(self, number: int) -> Launched:
        port = self._pick_port()
        argv = self._adapter.command(self._engine, self._spec, port)
        log_path = self._log_dir / f"{int(self._clock.wall() * 1000)}-{number}.log"
        # the deployment's variables first; what the adapter forces (or removes) wins
        env: dict[str, str | None] = {**self._spec.engine_config.env}
        env.update(self._adapter.environment(self._engine, self._spec))
        process = await self._processes.spawn(argv, log_path, env)
        # only engines that may still run are kept: a controller runs one at a time
        self._handles = {n: h for n, h in self._handles.items() if h.returncode() is None}
        self._handles[number] = process
        return Launched(
            number=number,
            address=EngineAddress(f"http://127.0.0.1:{port}"),
            pid=process.pid,
            port=port,
            log_path=str(log_path),
        )

    @property
    def host(self) -> None:
        """(see ``EngineEffects``): this machine."""
        return None

    async def reprove(self) -> None:
        """(see ``EngineEffects``): an engine on this machine is never away."""

    def leave(self) -> None:
        """(see ``EngineEffects``): an engine on this machine ends with the server."""

    def watch_exits(self, told: Callable[[], None]) -> bool:
        """(see ``EngineEffects``): a child process's exit is found by looking at it."""
        return False

    def exited(self, engine: Launched) -> int | None:
        return self._handles[engine.number].returncode()

    def ended_by(self, engine: Launched) -> str | None:
        return None  # a child of this process ends by itself, or by this process's own stop

    async def ready(self, engine: Launched) -> bool:
        return await self._adapter.ready(engine.address.url)

    async def stop(self, engine: Launched, grace: float) -> int:
        return await self._handles[engine.number].terminate(grace)

    async def park(self, engine: Launched) -> None:
        await self._adapter.park(engine.address.url, self._spec.residency)

    async def wake(self, engine: Launched) -> None:
        await self._adapter.wake(engine.address.url, self._spec.residency, str(self._spec.model))

    async def parked(self, engine: Launched) -> bool | None:
        return await self._adapter.parked(engine.address.url)

    async def canary(self, engine: Launched) -> str | None:
        if self._canary is None:
            return None
        return await self._canary(engine.address, self._spec.served_model)

    async def load(self, engine: Launched) -> EngineLoad | None:
        return await self._adapter.load(engine.address.url)

    def offline(self) -> CapyError | None:
        return None  # this machine
