"""A deployment whose engine CapyCTL runs: what commands, requests and the switchboard may ask of it.

Commands set what it should do (``Desired``) and return at once; its task
(``EngineTask``) acts on that through its ``EngineEffects``. Requests wait
on the shared state (``ManagedState``) and are told by ``route_step``.
Where its engines run is the effects' business: the same controller serves
local child processes (``LocalEngineEffects``) or any other implementation.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio

from capyctl.domain.deployments import FIRST_INSTANCE, Deployment, Desired, InstanceState
from capyctl.domain.engines import EngineInstall
from capyctl.domain.errors import (
    CapyError,
    DeadlineExceeded,
    DeploymentStopped,
    DeviceOffline,
    EngineRestarted,
    EngineUnavailable,
    HostUnreachable,
    LlmUnavailable,
)
from capyctl.domain.fields import RowChoice
from capyctl.domain.lifecycle import RouteStep, fresh_budget, give_way, gone, holding, route_step
from capyctl.domain.memory import Holding
from capyctl.domain.ports import Clock, EngineAdapter, EngineEffects, EngineLoad
from capyctl.domain.scheduling import Loading, Route
from capyctl.domain.settlement import ENGINE_STOP
from capyctl.services.controller_base import ControllerBase, ControllerSettings, InstanceStatus, Room
from capyctl.services.engine_task import EngineTask
from capyctl.services.events import Events
from capyctl.services.managed_state import ManagedState
from capyctl.services.switching import NoSwitchboard

S = InstanceState


class ManagedController(ControllerBase):
    """A deployment whose engine process CapyCTL runs."""

    managed = True

    def __init__(
        self,
        deployment: Deployment,
        engine: EngineInstall,
        adapter: EngineAdapter,
        effects: EngineEffects,
        clock: Clock,
        events: Events,
        settings: ControllerSettings,
        fields: RowChoice,
        room: Room | None = None,
        keep: Callable[[Deployment], None] = lambda deployment: None,
        index: int = FIRST_INSTANCE,
    ) -> None:
        super().__init__(deployment, engine, adapter, clock, events, fields, index)
        self._state = ManagedState(deployment, clock, events, keep, index)
        self._effects = effects
        self._task = EngineTask(
            self, self._state, effects, room or NoSwitchboard(), clock, events, settings, self.settlement
        )
        self._task_scope: anyio.CancelScope | None = None

    @property
    def status(self) -> InstanceStatus:
        return self._state.status

    @property
    def effects(self) -> EngineEffects:
        """What acts on its engines, wherever they run (``EngineEffects``)."""
        return self._effects

    @property
    def desired(self) -> Desired:
        return self._state.desired

    @property
    def launch(self) -> int:
        return self._state.launch

    @property
    def base_url(self) -> str:
        return self._state.latest.url

    def bind(self, task_group: anyio.abc.TaskGroup) -> None:
        """Start the controller's task (and its settlement's) in ``task_group``."""
        self.settlement.bind(task_group)
        self._task_scope, self._state.finished = anyio.CancelScope(), anyio.Event()
        task_group.start_soon(self._task.run, self._task_scope, self._state.finished)

    # --- commands -------------------------------------------------------------
    def want(self, desired: Desired) -> None:
        """An operator's command (or an apply): run (a FAILED deployment gets a new start budget),
        on demand, or stop. Returns at once; the controller's task acts on it."""
        state = self._state
        if fresh_budget(desired, state.status.state):
            state.failures, state.relaunch = 0, False  # a new start budget, and no backoff before it
        if desired is Desired.RUN and state.desired is not Desired.RUN:
            state.asks += 1
        state.desire(desired)

    def ask(self) -> None:
        if self._state.desired in (Desired.ON_DEMAND, Desired.PARK):  # a parked model wakes for a request
            self._state.asks += 1
            self._state.desire(Desired.RUN)

    async def until_settled(self) -> None:
        """Wait until a stop has taken effect (no engine left), or a later command wants it running."""
        state = self._state
        while state.desired is not Desired.RUN and state.status.state is not S.STOPPED and not state.done():
            await state.changed()

    async def close(self) -> None:
        """Stop for good (a delete, CapyCTL's shutdown): the engine is gone when this returns."""
        self._state.desire(Desired.STOP)
        if self._task_scope is None or self._state.finished is None:
            return
        await self.until_settled()
        self._task_scope.cancel()
        await self._state.finished.wait()

    # --- what the switchboard asks ------------------------------------------------------------
    @property
    def holding(self) -> Holding:
        return holding(self._state.holds, self._state.wake_granted, self._state.status.state)

    @property
    def movable(self) -> bool:
        """Ready or parked: in no transition, so it may be parked or stopped now."""
        return self._state.status.state in (S.READY, S.PARKED)

    def grant_room(self) -> None:
        if self._state.holds:  # a parked engine may take its awake footprint back
            self._state.wake_granted = True
        self._state.holds = True

    def unsettled_before_output(self) -> int:
        return sum(entry["count"] for entry in self.settlement.ledger.counts() if entry["rule"] == ENGINE_STOP)

    async def give_way(self, park: bool = False, why: str = "") -> None:
        """Park (``park``, when its residency can) or stop, not stickily: the next request wakes or starts it.

        Returns once the engine confirmed it sleeps, or once its process is gone. An engine stopped so (it
        cannot park, or was to make room) is the event ``gave_way`` (a park is ``parked``), saying ``why``.
        """
        state = self._state
        ran = state.holds
        parks, desired = give_way(park, self.spec.residency, state.holds, state.desired)
        if desired is not None:
            state.desire(desired)
        while state.holds and (not parks or state.status.state is not S.PARKED):
            await state.changed()
        if ran and not parks:
            asked = "park" if park else "stop"
            self._events.emit(self.name, "gave_way", instance=self.index, asked=asked, why=why)

    # --- what requests ask ------------------------------------------------------
    async def read_load(self) -> EngineLoad | None:
        engine = self._state.engine
        return None if engine is None else await self._effects.load(engine)

    @property
    def ended_by(self) -> str | None:
        ended = self._state.ended_by  # (kept until a later launch is ready)
        return ended[1] if ended is not None else None

    def held(self) -> CapyError | None:
        return self._effects.offline() if self._state.engine is not None else None

    def route_now(self) -> Route | None:
        if self._state.status.state is S.READY and self._effects.offline() is None:
            return Route(self._state.address, self._state.launch)
        return None

    async def route(self, timeout: float) -> Route:
        if (ready := self.route_now()) is not None:  # the common case: no scope, no waiting
            return ready
        state = self._state
        self.ask()
        attempt = state.asks
        with anyio.move_on_after(timeout):
            while True:
                if (offline := self._effects.offline()) is not None:  # its machine is out of reach: said now
                    raise offline
                refused = state.refused is not None and state.refused[0] == attempt
                step = route_step(state.desired, state.status.state, refused, state.done())
                if step is RouteStep.SERVE:
                    return Route(state.address, state.launch)
                if step is RouteStep.ASK_AGAIN:
                    self.ask()
                    attempt = state.asks
                    continue
                if step is not RouteStep.WAIT:
                    raise self._refusal(step)
                await state.changed()
        raise DeadlineExceeded(
            f"deployment {self.name!r} did not become ready within the request deadline of {timeout:.0f} s "
            f"(state {state.status.state}); engine log: {state.status.log_path}",
            model=self.name,
        )

    def _refusal(self, step: RouteStep) -> CapyError:
        """The error that tells a waiting request ``step``."""
        status = self._state.status
        if step is RouteStep.STOPPED:
            return DeploymentStopped(self.name)
        if step is RouteStep.REFUSED and self._state.refused is not None:
            return self._state.refused[1]  # no room on its device for the start this request asked for
        if step is RouteStep.FAILED:
            return LlmUnavailable(self.name, str(status.last_error), status.log_path)
        return EngineUnavailable(f"deployment {self.name!r} is shutting down", model=self.name)

    async def lost(self, route: Route, notice: float, broke: EngineUnavailable) -> CapyError | None:
        if isinstance(broke, HostUnreachable):  # the machine, not the engine: nothing to wait for
            return self._effects.offline() or broke.of(self.name)
        state = self._state
        with anyio.move_on_after(notice):  # the task sees an exit within its poll interval
            while not gone(route.launch, state.launch, state.status.state):
                await state.changed()
        if not gone(route.launch, state.launch, state.status.state):
            return self._effects.offline()  # its host went out of reach meanwhile (None on this machine)
        if state.desired is Desired.STOP:  # not a crash: an operator stopped it
            return DeploymentStopped(self.name, while_serving=True)
        if state.ended_by is not None and state.ended_by[0] == route.launch and self.host is not None:  # its host's
            return self._effects.offline() or DeviceOffline(  # doing, not the engine's: said so
                self.host, "reconnecting", model=self.name, retry_after=1
            )
        return EngineRestarted(self.name, str(state.status.last_error))

    def loading(self) -> Loading:
        state, status = self._state, self._state.status
        if status.state in (S.PARKING, S.PARKED, S.WAKING):
            waking_for = None if state.wake_began is None else self._clock.monotonic() - state.wake_began
            return Loading(str(status.state), waking_for, status.wake_times)
        starting_for = None if status.started_at is None else self._clock.wall() - status.started_at
        return Loading(str(status.state), starting_for, status.cold_starts)
