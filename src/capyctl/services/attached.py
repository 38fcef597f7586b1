"""A deployment whose engine runs outside CapyCTL: routed to, verified and relayed, never started or stopped."""

from __future__ import annotations

import contextlib

import anyio

from capyctl.domain.deployments import FIRST_INSTANCE, Deployment, Desired, InstanceState
from capyctl.domain.engines import EngineInstall
from capyctl.domain.errors import CapyError, DeploymentStopped, EngineUnavailable
from capyctl.domain.fields import RowChoice
from capyctl.domain.lifecycle import EngineAddress
from capyctl.domain.ports import Clock, EngineAdapter
from capyctl.domain.scheduling import Loading, Route
from capyctl.services.controller_base import ControllerBase, InstanceStatus, initial_desire, move
from capyctl.services.events import Events

S = InstanceState


class AttachedController(ControllerBase):
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
        self,
        deployment: Deployment,
        engine: EngineInstall,
        adapter: EngineAdapter,
        clock: Clock,
        events: Events,
        fields: RowChoice,
        index: int = FIRST_INSTANCE,
    ) -> None:
        super().__init__(deployment, engine, adapter, clock, events, fields, index)
        self._desired = initial_desire(deployment)
        self._status = InstanceStatus(
            index=index, cold_starts=list(deployment.cold_starts), wake_times=list(deployment.wake_times)
        )
        self._status.state = S.STOPPED if self._desired is Desired.STOP else S.UNAVAILABLE
        self._task_group: anyio.abc.TaskGroup | None = None
        self._address = EngineAddress(self.base_url)

    @property
    def base_url(self) -> str:
        return str(self.deployment.spec.endpoint).rstrip("/")

    @property
    def status(self) -> InstanceStatus:
        return self._status

    @property
    def desired(self) -> Desired:
        return self._desired

    def bind(self, task_group: anyio.abc.TaskGroup) -> None:
        self._task_group = task_group
        self.settlement.bind(task_group)

    def _set(self, state: InstanceState, error: str | None = None) -> None:
        if state is not self.status.state:
            self.status.last_error = error if error is not None else self.status.last_error
            move(self.status, state, self.name, self._clock, self._events)

    def want(self, desired: Desired) -> None:
        """Stop routing (stop), or resume it and check the engine now, so `--wait` sees it ready."""
        self._desired = desired
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
        # stays UNAVAILABLE (or stopped) when it fails; the next request checks again
        with contextlib.suppress(EngineUnavailable, DeploymentStopped):
            await self.route(self.attach_wait)

    def route_now(self) -> Route | None:
        return Route(self._address, self.launch) if self.status.state is S.READY else None

    def _stopped(self) -> bool:
        """An operator's stop holds (a call, so that it is read afresh after each wait)."""
        return self.desired is Desired.STOP

    async def route(self, timeout: float) -> Route:
        if (ready := self.route_now()) is not None:
            return ready
        with anyio.move_on_after(min(timeout, self.attach_wait)):
            while True:
                if self._stopped():
                    raise DeploymentStopped(self.name)
                answers = await self.adapter.ready(self.base_url)
                if self._stopped():  # stopped while it was being checked
                    raise DeploymentStopped(self.name)
                if answers:
                    self._set(S.READY)
                    return Route(self._address, self.launch)
                self._set(S.UNAVAILABLE, f"the attached engine at {self.base_url} does not answer")
                await anyio.sleep(0.25)
        raise EngineUnavailable(
            f"the attached engine of {self.name!r} at {self.base_url} did not answer its health check",
            model=self.name,
        )

    async def lost(self, route: Route, notice: float, broke: EngineUnavailable) -> CapyError | None:
        """A broken connection to an attached engine: check it again on the next request."""
        if self.status.state is S.READY:
            self._set(S.UNAVAILABLE, f"lost the connection to the attached engine at {self.base_url}")
        return None

    def loading(self) -> Loading:
        return Loading(str(self.status.state), None, [])
