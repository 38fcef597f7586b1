"""One controller per deployment: what is wanted of it, the instance that does it, what requests may ask.

Each deployment has one controller for as long as it exists. Commands set
what it should do (``Desired``: run, on demand, stop) and return at once; the
controller's own task compares that with what its engine does and acts, by
the domain's ``next_step`` and its transition table. Nothing stops an engine
by cancelling whoever runs it, so:

- an operator's stop holds in every window: a request arriving while the
  engine stops, one already waiting for a start, a FAILED deployment;
- a start given while a stop is under way is not lost: once the old engine
  is gone, the task starts a new one;
- an engine that crashes after each start backs off (``restart_delay``) and,
  after ``max_start_failures`` launches in a row, is FAILED with its last
  error until an operator starts it again.

``Serving`` is all the chat path may ask of a controller; the management API
and the listings read ``status``, ``desired`` and ``settlement`` for display.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Protocol

import anyio
import msgspec

from capyctl.domain.deployments import (
    Deployment,
    DeploymentSpec,
    Desired,
    InstanceState,
    Step,
    check_transition,
    next_step,
    restart_delay,
)
from capyctl.domain.engines import EngineInstall
from capyctl.domain.errors import (
    CapyError,
    DeadlineExceeded,
    DeploymentStopped,
    EngineRestarted,
    EngineUnavailable,
    GpuBusy,
    InsufficientMemory,
    LlmUnavailable,
)
from capyctl.domain.fields import RowChoice
from capyctl.domain.memory import Holding, Residency
from capyctl.domain.ports import Clock, EngineAdapter, ProcessControl, ProcessHandle
from capyctl.domain.requests import RequestRecord
from capyctl.domain.scheduling import Loading, Route
from capyctl.domain.settlement import ENGINE_STOP
from capyctl.services.events import Events
from capyctl.services.settling import Settlement
from capyctl.services.switching import NoSwitchboard, Occupant

log = logging.getLogger("capyctl.controller")
S = InstanceState


class Serving(Protocol):
    """What the chat path may ask of a deployment's controller."""

    @property
    def name(self) -> str: ...
    @property
    def spec(self) -> DeploymentSpec: ...
    @property
    def engine(self) -> EngineInstall: ...
    @property
    def fields(self) -> RowChoice: ...
    @property
    def ready(self) -> bool: ...

    def ask(self) -> None:
        """A request wants the model: start it unless it runs, an operator's stop holds, or it FAILED."""

    async def route(self, timeout: float) -> Route:
        """Wait until the engine is ready (asking for it); raises DeploymentStopped, LlmUnavailable,
        EngineUnavailable or DeadlineExceeded."""

    def route_now(self) -> Route | None:
        """The engine's route while it is ready (what ``route`` returns at once then); None otherwise."""

    async def lost(self, route: Route, notice: float) -> CapyError | None:
        """After a broken engine connection: the error that says why, when the engine of ``route`` is gone
        (waiting up to ``notice`` seconds to see it exit); None while it still runs."""

    def loading(self) -> Loading: ...

    def cut(self, record: RequestRecord) -> None:
        """A request sent to this deployment's engine was cut: it stays counted until settled."""


class Room(Protocol):
    """Where a managed controller asks for room on its device before each launch (``Switchboard``)."""

    async def claim(self, occupant: Occupant) -> None: ...


class ControllerSettings(msgspec.Struct, kw_only=True, frozen=True):
    startup_timeout: float = 600.0
    stop_grace: float = 10.0
    poll_interval: float = 0.05
    ready_poll: float = 0.01  # seconds between readiness checks of a starting engine (a waiting request pays it)
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
    wake_times: list[float] = msgspec.field(default_factory=list)  # seconds from a wake's start to ready, last 20


def initial_desire(deployment: Deployment) -> Desired:
    return Desired.STOP if deployment.operator_stopped else Desired.ON_DEMAND


class _Controller:
    """What both kinds of controller share: the deployment, its engine, the desired state, settlement."""

    def __init__(
        self, deployment: Deployment, engine: EngineInstall, adapter: EngineAdapter, clock: Clock, events: Events,
        fields: RowChoice,
    ) -> None:
        self.deployment = deployment
        self.engine = engine
        self.adapter = adapter
        self.fields = fields
        self._clock = clock
        self._events = events
        self.desired = initial_desire(deployment)
        self.status = InstanceStatus(cold_starts=list(deployment.cold_starts), wake_times=list(deployment.wake_times))
        self.settlement = Settlement(self.name, adapter, clock, events, lambda: self.base_url)

    @property
    def name(self) -> str:
        return self.deployment.spec.name

    @property
    def spec(self) -> DeploymentSpec:
        return self.deployment.spec

    @property
    def base_url(self) -> str:
        raise NotImplementedError

    @property
    def ready(self) -> bool:
        return self.status.state is S.READY

    def cut(self, record: RequestRecord) -> None:
        self.settlement.cut(record)

    def _changed_to(self, state: InstanceState) -> None:
        """Move the instance along the transition table, and say so."""
        check_transition(self.status.state, state)
        previous, self.status.state = self.status.state, state
        if state is S.READY:
            self.status.ready_at = self._clock.wall()
        self._events.emit(self.name, "state_changed", instance=0, previous=str(previous), state=str(state))


class ManagedController(_Controller):
    """A deployment whose engine process CapyCTL runs."""

    managed = True

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
        settings: ControllerSettings,
        fields: RowChoice,
        room: Room | None = None,
        canary: Callable[[str, str], Awaitable[str]] | None = None,
        keep: Callable[[Deployment], None] = lambda deployment: None,
    ) -> None:
        super().__init__(deployment, engine, adapter, clock, events, fields)
        self._room: Room = room or NoSwitchboard()
        self._holds = False  # granted room on its device, until its engine process is gone
        self._wake_granted = False  # a parked engine was granted room for its awake footprint
        self._keep = keep  # stores the deployment record (its measured times)
        self._canary = canary  # the fixed request a woken engine must answer as before it parked
        self._reference: str | None = None  # this launch's answer to it, at its first readiness
        self._wake_began: float | None = None
        self._asks = 0  # starts asked for (by requests or an operator); a refusal answers one of them
        self._refused: tuple[int, CapyError] | None = None
        self._processes = processes
        self._pick_port = pick_port
        self._log_dir = log_dir
        self._settings = settings
        self.launch = 0
        self._url = ""
        self._failures = 0  # launches in a row that never became stable
        self._relaunch = False  # the last launch ended by itself: the next one comes after a backoff
        self._process: ProcessHandle | None = None
        self._changed = anyio.Event()  # set (and replaced) whenever the state or the desired state changes
        self._launch_scope: anyio.CancelScope | None = None
        self._task_scope: anyio.CancelScope | None = None
        self._finished: anyio.Event | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.status.port}"

    def bind(self, task_group: anyio.abc.TaskGroup) -> None:
        """Start the controller's task (and its settlement's) in ``task_group``."""
        self.settlement.bind(task_group)
        self._task_scope, self._finished = anyio.CancelScope(), anyio.Event()
        task_group.start_soon(self._control, self._task_scope, self._finished)

    # --- commands -------------------------------------------------------------
    def want(self, desired: Desired) -> None:
        """An operator's command (or an apply): run (a FAILED deployment gets a new start budget),
        on demand, or stop. Returns at once; the controller's task acts on it."""
        if desired is Desired.RUN and self.status.state in (S.STOPPED, S.FAILED):
            self._failures, self._relaunch = 0, False  # a new start budget, and no backoff before it
        if desired is Desired.RUN and self.desired is not Desired.RUN:
            self._asks += 1
        self._desire(desired)

    def ask(self) -> None:
        if self.desired in (Desired.ON_DEMAND, Desired.PARK):  # a parked model wakes for a request
            self._asks += 1
            self._desire(Desired.RUN)

    # --- what the switchboard asks ------------------------------------------------------------
    @property
    def holding(self) -> Holding:
        """What it holds on its device, by the evidence: awake from the grant of room until the process is
        gone, except while the engine has confirmed it sleeps."""
        if not self._holds:
            return Holding.NONE
        if self.status.state is S.PARKED and not self._wake_granted:
            return Holding.PARKED
        return Holding.AWAKE

    @property
    def movable(self) -> bool:
        """Ready or parked: in no transition, so it may be parked or stopped now."""
        return self.status.state in (S.READY, S.PARKED)

    def grant_room(self) -> None:
        if self._holds:  # a parked engine may take its awake footprint back
            self._wake_granted = True
        self._holds = True

    def unsettled_before_output(self) -> int:
        return sum(entry["count"] for entry in self.settlement.ledger.counts() if entry["rule"] == ENGINE_STOP)

    async def give_way(self, park: bool = False) -> None:
        """Park (``park``, when its residency can) or stop, not stickily: the next request wakes or starts it.

        Returns once the engine confirmed it sleeps, or once its process is gone.
        """
        if park and self.spec.residency is not Residency.RESTART_ONLY and self._holds:
            if self.desired is not Desired.STOP:
                self._desire(Desired.PARK)
            while self._holds and self.status.state is not S.PARKED:
                await self._changed.wait()
            return
        if self.desired in (Desired.RUN, Desired.PARK):
            self._desire(Desired.ON_DEMAND)
        while self._holds:
            await self._changed.wait()

    def _desire(self, desired: Desired) -> None:
        self.desired = desired
        if desired is Desired.RUN and self.status.state in (S.STOPPED, S.FAILED):
            self._set(S.STARTING)  # at once, so the very next look at it says it is starting
        elif desired in (Desired.ON_DEMAND, Desired.STOP) and self._launch_scope is not None:
            self._launch_scope.cancel()  # no engine should run: the launch's cleanup terminates it
        self._notify()

    async def until_settled(self) -> None:
        """Wait until a stop has taken effect (no engine left), or a later command wants it running."""
        while self.desired is not Desired.RUN and self.status.state is not S.STOPPED and not self._done():
            await self._changed.wait()

    async def close(self) -> None:
        """Stop for good (a delete, CapyCTL's shutdown): the engine is gone when this returns."""
        self._desire(Desired.STOP)
        if self._task_scope is None or self._finished is None:
            return
        await self.until_settled()
        self._task_scope.cancel()
        await self._finished.wait()

    def _done(self) -> bool:
        return self._finished is not None and self._finished.is_set()

    # --- what requests ask ------------------------------------------------------
    def route_now(self) -> Route | None:
        return Route(self._url, self.launch) if self.status.state is S.READY else None

    async def route(self, timeout: float) -> Route:
        if (ready := self.route_now()) is not None:  # the common case: no scope, no waiting
            return ready
        self.ask()
        attempt = self._asks
        with anyio.move_on_after(timeout):
            while True:
                if self.desired is Desired.STOP:
                    raise DeploymentStopped(self.name)
                if self._refused is not None and self._refused[0] == attempt:
                    raise self._refused[1]  # no room on its device for the start this request asked for
                state = self.status.state
                if state is S.READY:
                    return Route(self._url, self.launch)
                if state in (S.STOPPED, S.PARKED) and self.desired in (Desired.ON_DEMAND, Desired.PARK):
                    self.ask()  # it gave way to a switch meanwhile: ask for it again
                    attempt = self._asks
                    continue
                if state is S.FAILED:
                    raise LlmUnavailable(self.name, str(self.status.last_error), self.status.log_path)
                if self._done():
                    raise EngineUnavailable(f"deployment {self.name!r} is shutting down", model=self.name)
                await self._changed.wait()
        raise DeadlineExceeded(
            f"deployment {self.name!r} did not become ready within the request deadline of {timeout:.0f} s "
            f"(state {self.status.state}); engine log: {self.status.log_path}",
            model=self.name,
        )

    async def lost(self, route: Route, notice: float) -> CapyError | None:
        with anyio.move_on_after(notice):  # the watcher sees an exit within its poll interval
            while not self._gone(route.launch):
                await self._changed.wait()
        if not self._gone(route.launch):
            return None
        if self.desired is Desired.STOP:  # not a crash: an operator stopped it
            return DeploymentStopped(self.name, while_serving=True)
        return EngineRestarted(self.name, str(self.status.last_error))

    def _gone(self, launch: int) -> bool:
        """True once the engine of ``launch`` is no longer the one serving (crashed, stopping, replaced)."""
        return launch != self.launch or self.status.state is not S.READY

    def loading(self) -> Loading:
        status = self.status
        if status.state in (S.PARKING, S.PARKED, S.WAKING):
            waking_for = None if self._wake_began is None else self._clock.monotonic() - self._wake_began
            return Loading(str(status.state), waking_for, status.wake_times)
        starting_for = None if status.started_at is None else self._clock.wall() - status.started_at
        return Loading(str(status.state), starting_for, status.cold_starts)

    # --- the controller's task ---------------------------------------------------
    def _set(self, state: InstanceState) -> None:
        if state is S.READY:
            self._url = self.base_url
        self._changed_to(state)
        if state is S.READY and self.status.started_at is not None and self.status.ready_at is not None:
            self.status.cold_starts = [*self.status.cold_starts[-19:], self.status.ready_at - self.status.started_at]
            self._measured()
        self._notify()

    def _measured(self) -> None:
        """Keep the measured start and wake times with the deployment, so they outlive CapyCTL's restarts."""
        self.deployment.cold_starts = self.status.cold_starts
        self.deployment.wake_times = self.status.wake_times
        self._keep(self.deployment)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    async def _control(self, scope: anyio.CancelScope, finished: anyio.Event) -> None:
        """Reconcile until the deployment is closed or CapyCTL shuts down: then no engine is left."""
        try:
            with scope:
                while True:
                    try:
                        await self._step()
                    except Exception as exc:  # noqa: BLE001 - one deployment's fault must not end the others
                        log.exception("the controller of %s met an unexpected error", self.name)
                        self.status.last_error = f"CapyCTL's controller failed: {type(exc).__name__}: {exc}"
                        self._events.emit(self.name, "controller_failed", instance=0, reason=self.status.last_error)
                        self._failures, self._relaunch = self._settings.max_start_failures, False
                        self.status.state = S.FAILED  # no engine runs here (launches end theirs): FAILED until
                        self._notify()  # an operator's start; what requests wait for is told at once
                        await self._changed.wait()  # and nothing is tried again before a command
        finally:
            self._to_stopped()  # the launch's own cleanup has terminated the engine
            finished.set()
            self._notify()

    async def _step(self) -> None:
        step = next_step(self.desired, self.status.state, self._failures, self._settings.max_start_failures)
        if step is Step.LAUNCH:
            await self._launch()
        elif step is Step.FAIL:
            self._set(S.FAILED)
        elif step is Step.SETTLE:
            self._to_stopped()
        else:
            await self._changed.wait()

    async def _launch(self) -> None:
        """One launch, after the backoff its failures call for; a change of the desired state cancels it."""
        with anyio.CancelScope() as scope:
            self._launch_scope = scope
            if self.status.state is not S.STARTING:
                self._set(S.STARTING)
            if self._relaunch:
                delay = restart_delay(self._failures or 1)
                self._events.emit(self.name, "engine_restarting", instance=0, after_s=delay)
                await anyio.sleep(delay)
                self.status.restarts += 1
            try:
                stable = await self._launch_once()
            except (InsufficientMemory, GpuBusy) as refusal:  # no room: the requests that asked are told
                self._refused = (self._asks, refusal)
                self.status.last_error = refusal.message
                self.desired = Desired.ON_DEMAND
                self._to_stopped()
                return
            except Exception as exc:  # noqa: BLE001 - a launch that broke (no log folder, a failed fork ...)
                # is a failed start, after the launch's own cleanup ended its process: backoff, then FAILED
                log.exception("the launch of %s's engine failed", self.name)
                self.status.last_error = f"could not launch the engine: {type(exc).__name__}: {exc}"
                self._events.emit(self.name, "engine_start_failed", instance=0, reason=self.status.last_error)
                stable = False
            self._failures = 0 if stable else self._failures + 1
            self._relaunch = True
        self._launch_scope = None
        if scope.cancelled_caught:  # stopped on purpose: the next start is a fresh one
            self._failures, self._relaunch = 0, False
            self._to_stopped()

    def _to_stopped(self) -> None:
        """No engine runs: show STOPPED (a FAILED deployment stays FAILED unless it is no longer wanted)."""
        state = self.status.state
        if state in (S.STARTING, S.READY, S.PARKING, S.PARKED, S.WAKING):
            self._set(state := S.STOPPING)
        if state is S.STOPPING or (state is S.FAILED and self.desired is not Desired.RUN):
            self._set(S.STOPPED)

    async def _launch_once(self) -> bool:
        """Run one engine process to its end; True if it was ready for ``stable_after`` before it ended.

        A launch that never became ready, or crashed soon after, counts as a failed start, so an
        engine that crashes after each start backs off and ends FAILED.
        """
        await self._room.claim(self)
        try:
            return await self._run_engine()
        finally:
            self._holds = self._wake_granted = False  # the process is gone (or never began): what it held is free
            self._notify()

    async def _run_engine(self) -> bool:
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
        cancelled = False
        try:
            if not await self._until_ready(process):
                return False
            self._reference = await self._first_answer() if self._parks else None
            self._set(S.READY)
            ready_at = self._clock.monotonic()
            while (code := process.returncode()) is None:
                if self.desired is Desired.PARK and self.status.state is S.READY:
                    await self._park()
                elif self.desired is Desired.RUN and self.status.state is S.PARKED:
                    await self._wake()
                else:
                    with anyio.move_on_after(self._settings.poll_interval):
                        await self._changed.wait()
            self.status.last_error = f"engine exited with status {code} while serving"
            self._events.emit(self.name, "engine_crashed", instance=0, status=code, log=str(log_path))
            self._set(S.STARTING)  # at once: no request may be routed to the dead engine
            return self._clock.monotonic() - ready_at >= self._settings.stable_after
        except anyio.get_cancelled_exc_class():
            cancelled = True
            raise
        finally:
            with anyio.CancelScope(shield=True):
                # a stop (a cancellation) is shown as STOPPING while the engine ends; a launch that broke (its
                # error goes on to _launch: a failed start) ends its engine in STARTING, as a failed start does
                if process.returncode() is None:
                    if cancelled:
                        self._set(S.STOPPING)
                    elif self.status.state is not S.STARTING:
                        self._set(S.STARTING)  # (no request may be routed to the engine being ended)
                await process.terminate(self._settings.stop_grace)
                self.status.pid = None
                self.settlement.engine_ended()  # the process is gone: what it counted is settled
                self._notify()

    @property
    def _parks(self) -> bool:
        return self.spec.residency is not Residency.RESTART_ONLY

    async def _park(self) -> None:
        """Sleep (the switchboard drained it first); a park the engine does not confirm becomes a stop."""
        began = self._clock.monotonic()
        self._set(S.PARKING)
        try:
            await self.adapter.park(self.base_url, self.spec.residency)
            confirmed = await self.adapter.parked(self.base_url)
            why = "the engine still says it is awake"
        except CapyError as exc:
            confirmed, why = False, exc.message
        if confirmed is False:  # None: the engine cannot tell, and its answer to the park is the evidence
            error = f"the engine did not park ({why}); stopped instead"
            self._events.emit(self.name, "park_failed", instance=0, reason=error)
            self._give_up(error)
            return
        self._set(S.PARKED)
        self._events.emit(self.name, "parked", instance=0, residency=str(self.spec.residency),
                          seconds=round(self._clock.monotonic() - began, 3))

    async def _wake(self) -> None:
        """Room for the awake footprint, the engine's wake, then the canary: a woken engine must answer its
        fixed request as it did before it parked, or it is stopped (the next request starts it afresh)."""
        self._wake_began = began = self._clock.monotonic()
        try:
            await self._room.claim(self)
        except (InsufficientMemory, GpuBusy) as refusal:  # it stays parked; the requests that asked are told
            self._refused = (self._asks, refusal)
            self.desired = Desired.PARK
            self._notify()
            return
        self._set(S.WAKING)
        try:
            await self.adapter.wake(self.base_url, self.spec.residency, str(self.spec.model))
            if await self.adapter.parked(self.base_url):
                raise EngineUnavailable("the engine still says it is asleep after its wake", model=self.name)
            answer = await self._ask_canary()
        except CapyError as exc:
            error = f"the engine did not wake: {exc.message}"
            self._events.emit(self.name, "wake_failed", instance=0, reason=error)
            self._give_up(error)
            return
        if self._reference is not None and answer != self._reference:
            self._events.emit(self.name, "wake_mismatch", instance=0, expected=self._reference, got=answer)
            self._give_up(f"wake_mismatch: after its wake the engine answered {answer!r} to the canary, "
                          f"not {self._reference!r} as before it parked")
            return
        self._wake_granted = False
        seconds = self._clock.monotonic() - began
        self.status.wake_times = [*self.status.wake_times[-19:], seconds]
        self._measured()
        self._set(S.READY)
        self._events.emit(self.name, "woken", instance=0, seconds=round(seconds, 3))

    def _give_up(self, error: str) -> None:
        """Stop this engine (not stickily): a failed park or wake frees its memory by the process's end."""
        self.status.last_error = error
        self._desire(Desired.ON_DEMAND)

    async def _first_answer(self) -> str | None:
        """The canary's answer at this launch's first readiness, kept to compare after each wake."""
        try:
            return await self._ask_canary()
        except CapyError as exc:
            self._events.emit(self.name, "canary_unanswered", instance=0, reason=exc.message)
            return None  # nothing to compare with: wakes of this launch are not checked

    async def _ask_canary(self) -> str | None:
        if self._canary is None:
            return None
        try:
            with anyio.fail_after(120):
                return await self._canary(self.base_url, self.spec.served_model)
        except (CapyError, TimeoutError) as exc:
            if isinstance(exc, TimeoutError):
                raise EngineUnavailable("the canary request got no answer within 120 s", model=self.name) from exc
            raise

    async def _until_ready(self, process: ProcessHandle) -> bool:
        deadline = self._clock.monotonic() + self._settings.startup_timeout
        while self._clock.monotonic() < deadline:
            if (code := process.returncode()) is not None:
                self.status.last_error = f"engine exited with status {code} while starting"
                self._events.emit(self.name, "engine_start_failed", instance=0, status=code)
                return False
            if await self.adapter.ready(self.base_url):
                return True
            await anyio.sleep(self._settings.ready_poll)
        with anyio.CancelScope(shield=True):
            await process.terminate(self._settings.stop_grace)
        self.status.last_error = f"engine not ready after {self._settings.startup_timeout:.0f} s"
        self._events.emit(self.name, "engine_start_failed", instance=0, reason="startup timeout")
        return False


class AttachedController(_Controller):
    """A deployment whose engine runs outside CapyCTL, reached at its ``endpoint``.

    CapyCTL routes to it, verifies and relays its streams, but never starts or
    stops it. Its state is READY while it answers and UNAVAILABLE once a
    health check or a request fails to reach it; the next request checks it
    again. An operator's stop only stops routing (STOPPED); a start resumes it.
    """

    launch = 1
    managed = False
    attach_wait = 10.0  # seconds a request waits for an attached engine that does not answer

    def __init__(
        self, deployment: Deployment, engine: EngineInstall, adapter: EngineAdapter, clock: Clock, events: Events,
        fields: RowChoice,
    ) -> None:
        super().__init__(deployment, engine, adapter, clock, events, fields)
        self.status.state = S.STOPPED if self.desired is Desired.STOP else S.UNAVAILABLE
        self._task_group: anyio.abc.TaskGroup | None = None

    @property
    def base_url(self) -> str:
        return str(self.deployment.spec.endpoint).rstrip("/")

    def bind(self, task_group: anyio.abc.TaskGroup) -> None:
        self._task_group = task_group
        self.settlement.bind(task_group)

    def _set(self, state: InstanceState, error: str | None = None) -> None:
        if state is not self.status.state:
            self.status.last_error = error if error is not None else self.status.last_error
            self._changed_to(state)

    def want(self, desired: Desired) -> None:
        """Stop routing (stop), or resume it and check the engine now, so `--wait` sees it ready."""
        self.desired = desired
        if desired is Desired.STOP:
            self._set(S.STOPPED)
            return
        if self.status.state is S.STOPPED:
            self._set(S.UNAVAILABLE)
        if desired is Desired.RUN and self.status.state is not S.READY and self._task_group is not None:
            self._task_group.start_soon(self._check)

    def ask(self) -> None:
        """Nothing to start: the engine runs outside CapyCTL."""

    async def until_settled(self) -> None:
        """An attached engine has no process of CapyCTL's to wait for."""

    async def close(self) -> None:
        self.want(Desired.STOP)

    async def _check(self) -> None:
        try:
            await self.route(self.attach_wait)
        except (EngineUnavailable, DeploymentStopped):
            pass  # stays UNAVAILABLE (or stopped); the next request checks again

    def route_now(self) -> Route | None:
        return Route(self.base_url, self.launch) if self.status.state is S.READY else None

    async def route(self, timeout: float) -> Route:
        if (ready := self.route_now()) is not None:
            return ready
        with anyio.move_on_after(min(timeout, self.attach_wait)):
            while True:
                if self.desired is Desired.STOP:
                    raise DeploymentStopped(self.name)
                answers = await self.adapter.ready(self.base_url)
                if self.desired is Desired.STOP:  # stopped while it was being checked
                    raise DeploymentStopped(self.name)
                if answers:
                    self._set(S.READY)
                    return Route(self.base_url, self.launch)
                self._set(S.UNAVAILABLE, f"the attached engine at {self.base_url} does not answer")
                await anyio.sleep(0.25)
        raise EngineUnavailable(
            f"the attached engine of {self.name!r} at {self.base_url} did not answer its health check",
            model=self.name,
        )

    async def lost(self, route: Route, notice: float) -> CapyError | None:
        """A broken connection to an attached engine: check it again on the next request."""
        if self.status.state is S.READY:
            self._set(S.UNAVAILABLE, f"lost the connection to the attached engine at {self.base_url}")
        return None

    def loading(self) -> Loading:
        return Loading(str(self.status.state), None, [])


Controller = ManagedController | AttachedController  # what serves one deployment
