"""One deployment's engine instance: start, readiness, crash restarts, stop.

While a deployment should run, one task (``_run``) owns its engine process:
it spawns it, polls readiness, then watches it. An engine that exits on its
own is restarted with backoff (``restart_delay``); ``launch`` counts the
launches so a request can tell that the engine it was using is gone. After
``max_start_failures`` launches in a row that never became ready, the
instance is FAILED until something asks for it again. ``stop`` cancels the
task; the process is terminated under a shielded scope, so an engine is
never left running, whatever cancelled us.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import anyio
import msgspec

from capyctl.domain.deployments import Deployment, InstanceState, check_transition, restart_delay
from capyctl.domain.engines import EngineInstall
from capyctl.domain.errors import DeadlineExceeded, DeploymentStopped, LlmUnavailable
from capyctl.domain.fields import RowChoice
from capyctl.domain.ports import Clock, EngineAdapter, ProcessControl, ProcessHandle
from capyctl.services.events import Events
from capyctl.services.settling import Settlement

log = logging.getLogger("capyctl.supervisor")
S = InstanceState


class SupervisorSettings(msgspec.Struct, kw_only=True, frozen=True):
    startup_timeout: float = 600.0
    stop_grace: float = 10.0
    poll_interval: float = 0.05
    max_start_failures: int = 5  # launches in a row that failed to start, or crashed soon after, before FAILED
    stable_after: float = 60.0  # seconds ready after which a crash no longer counts as a failed start


class InstanceStatus(msgspec.Struct, kw_only=True):
    index: int = 0
    state: InstanceState = S.STOPPED
    pid: int | None = None
    port: int | None = None
    started_at: float | None = None
    ready_at: float | None = None
    restarts: int = 0
    last_error: str | None = None
    log_path: str | None = None
    cold_starts: list[float] = msgspec.field(default_factory=list)  # seconds from spawn to ready, last 20


class Supervisor:
    managed = True  # CapyCTL runs this engine's process

    def __init__(
        self,
        deployment: Deployment,
        engine: EngineInstall,
        adapter: EngineAdapter,
        processes: ProcessControl,
        clock: Clock,
        events: Events,
        pick_port: Callable[[], int],
        log_dir: Path,
        settings: SupervisorSettings,
        fields: RowChoice,
    ) -> None:
        self.deployment = deployment
        self.fields = fields
        self.engine = engine
        self.adapter = adapter
        self._processes = processes
        self._clock = clock
        self._events = events
        self._pick_port = pick_port
        self._log_dir = log_dir
        self._settings = settings
        self.status = InstanceStatus()
        self.launch = 0
        self._process: ProcessHandle | None = None
        self._changed = anyio.Event()
        self._task_group: anyio.abc.TaskGroup | None = None
        self._scope: anyio.CancelScope | None = None
        self.settlement = Settlement(self.name, adapter, clock, events, lambda: self.base_url)

    @property
    def name(self) -> str:
        return self.deployment.spec.name

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.status.port}"

    def _set(self, state: InstanceState, error: str | None = None) -> None:
        check_transition(self.status.state, state)
        previous, self.status.state = self.status.state, state
        if error is not None:
            self.status.last_error = error
        if state is S.READY:
            self.status.ready_at = self._clock.wall()
            if self.status.started_at is not None:
                self.status.cold_starts = [*self.status.cold_starts[-19:], self.status.ready_at - self.status.started_at]
        self._events.emit(self.name, "state_changed", instance=0, previous=str(previous), state=str(state))
        self._changed.set()
        self._changed = anyio.Event()

    def bind(self, task_group: anyio.abc.TaskGroup) -> None:
        self._task_group = task_group
        self.settlement.bind(task_group)

    def start(self) -> None:
        """Begin starting the engine unless it runs or is starting already. Returns at once.

        Not while an operator's stop holds; a FAILED instance starts again (an operator's start).
        """
        if self.status.state in (S.STARTING, S.READY, S.STOPPING) or self.deployment.operator_stopped:
            return
        assert self._task_group is not None, "supervisor not bound to a task group"
        self._set(S.STARTING)
        self._scope = anyio.CancelScope()  # created now, so a stop() before _run begins still works
        self._task_group.start_soon(self._run, self._scope)

    async def wait_ready(self, timeout: float) -> str:
        """Start if needed and wait until ready; the engine's base URL.

        A STOPPED instance is started for the request. A FAILED one is not:
        it failed its whole start budget, and requests get ``llm-unavailable``
        until an operator starts it. An operator's stop is sticky in every
        window: a request waiting when it comes gets ``deployment_stopped``.
        """
        if self.status.state is S.READY:  # the common case: no scope, no waiting
            return self.base_url
        with anyio.move_on_after(timeout):
            while True:
                state = self.status.state
                if self.deployment.operator_stopped:
                    raise DeploymentStopped(self.name)
                if state is S.READY:
                    return self.base_url
                if state is S.FAILED:
                    raise self._unavailable()
                if state is S.STOPPED:
                    self.start()
                    continue
                await self._changed.wait()
        raise DeadlineExceeded(
            f"deployment {self.name!r} did not become ready within the request deadline of {timeout:.0f} s "
            f"(state {self.status.state}); engine log: {self.status.log_path}",
            model=self.name,
        )

    def _unavailable(self) -> LlmUnavailable:
        return LlmUnavailable(self.name, str(self.status.last_error), self.status.log_path)

    async def stop(self) -> None:
        """Stop the engine and wait until it is gone."""
        if self._scope is not None:
            self._scope.cancel()
        while self.status.state in (S.STARTING, S.READY, S.STOPPING):
            await self._changed.wait()

    def engine_gone(self, launch: int) -> bool:
        """True when the engine of ``launch`` has exited (crashed, restarted or stopped)."""
        if launch != self.launch:
            return True
        process = self._process
        return process is None or process.returncode() is not None

    async def _run(self, scope: anyio.CancelScope) -> None:
        """Launch, watch and relaunch the engine until cancelled (stop or shutdown) or FAILED."""
        failures = 0
        try:
            with scope:
                while True:
                    stable = await self._launch_once()
                    failures = 0 if stable else failures + 1
                    if failures >= self._settings.max_start_failures:
                        self._set(S.FAILED)
                        return
                    if self.status.state is not S.STARTING:
                        self._set(S.STARTING)
                    delay = restart_delay(failures or 1)
                    self._events.emit(self.name, "engine_restarting", instance=0, after_s=delay)
                    await anyio.sleep(delay)
                    self.status.restarts += 1
        finally:
            # Whoever cancelled us (an operator's stop, CapyCTL's shutdown), the state ends STOPPED.
            if self._scope is scope:
                self._scope = None
            if self.status.state in (S.STARTING, S.READY):
                self._set(S.STOPPING)
            if self.status.state is S.STOPPING:
                self._set(S.STOPPED)

    async def _launch_once(self) -> bool:
        """Run one engine process to its end; True if it was ready for ``stable_after`` before it ended.

        A launch that never became ready, or crashed soon after, counts as a failed start, so an
        engine that crashes after each start backs off and ends FAILED.
        """
        self.launch += 1
        port = self._pick_port()
        argv = self.adapter.command(self.engine, self.deployment.spec, port)
        log_path = self._log_dir / f"{int(self._clock.wall() * 1000)}-{self.launch}.log"
        self.status.port, self.status.log_path = port, str(log_path)
        self.status.started_at = self._clock.wall()
        # the deployment's variables first; what the adapter forces (or removes) wins
        env: dict[str, str | None] = {**self.deployment.spec.engine_config.env}
        env.update(self.adapter.environment(self.engine, self.deployment.spec))
        self._process = process = await self._processes.spawn(argv, log_path, env)
        self.status.pid = process.pid
        self._events.emit(self.name, "engine_started", instance=0, pid=process.pid, port=port)
        try:
            if not await self._until_ready(process):
                return False
            self._set(S.READY)
            ready_at = self._clock.monotonic()
            while (code := process.returncode()) is None:
                await anyio.sleep(self._settings.poll_interval)
            self.status.last_error = f"engine exited with status {code} while serving"
            self._events.emit(self.name, "engine_crashed", instance=0, status=code, log=str(log_path))
            self._set(S.STARTING)  # at once: no request may be routed to the dead engine
            return self._clock.monotonic() - ready_at >= self._settings.stable_after
        finally:
            with anyio.CancelScope(shield=True):
                if process.returncode() is None:  # only a cancellation leaves it running here
                    self._set(S.STOPPING)
                await process.terminate(self._settings.stop_grace)
                self.status.pid = None
                self.settlement.engine_ended()  # the process is gone: what it counted is settled

    async def _until_ready(self, process: ProcessHandle) -> bool:
        deadline = self._clock.monotonic() + self._settings.startup_timeout
        while self._clock.monotonic() < deadline:
            if (code := process.returncode()) is not None:
                self.status.last_error = f"engine exited with status {code} while starting"
                self._events.emit(self.name, "engine_start_failed", instance=0, status=code)
                return False
            if await self.adapter.ready(self.base_url):
                return True
            await anyio.sleep(0.1)
        with anyio.CancelScope(shield=True):
            await process.terminate(self._settings.stop_grace)
        self.status.last_error = f"engine not ready after {self._settings.startup_timeout:.0f} s"
        self._events.emit(self.name, "engine_start_failed", instance=0, reason="startup timeout")
        return False
