"""An attached engine: one that runs outside CapyCTL, reached at the deployment's ``endpoint``.

CapyCTL routes to it, verifies and relays its streams, but never starts or
stops it. Its state is READY while it answers and UNAVAILABLE once a health
check or a request fails to reach it; the next request checks it again.
An operator's ``stop`` only stops routing (STOPPED), ``start`` resumes it.
"""

from __future__ import annotations

import anyio

from capyctl.domain.deployments import Deployment, InstanceState
from capyctl.domain.engines import EngineInstall
from capyctl.domain.errors import EngineUnavailable
from capyctl.domain.fields import RowChoice
from capyctl.domain.ports import Clock, EngineAdapter
from capyctl.services.events import Events
from capyctl.services.settling import Settlement
from capyctl.services.supervisor import InstanceStatus

S = InstanceState


class AttachedSupervisor:
    launch = 1
    managed = False  # CapyCTL does not run this engine's process
    attach_wait = 10.0  # seconds a request waits for an attached engine that does not answer

    def __init__(
        self,
        deployment: Deployment,
        engine: EngineInstall,
        adapter: EngineAdapter,
        clock: Clock,
        events: Events,
        fields: RowChoice,
    ) -> None:
        self.deployment = deployment
        self.engine = engine
        self.adapter = adapter
        self.fields = fields
        self._clock = clock
        self._events = events
        self.status = InstanceStatus(state=S.UNAVAILABLE)
        self._task_group: anyio.abc.TaskGroup | None = None
        self.settlement = Settlement(self.name, adapter, clock, events, lambda: self.base_url)

    @property
    def name(self) -> str:
        return self.deployment.spec.name

    @property
    def base_url(self) -> str:
        return str(self.deployment.spec.endpoint).rstrip("/")

    def bind(self, task_group: anyio.abc.TaskGroup) -> None:
        self._task_group = task_group
        self.settlement.bind(task_group)

    def _set(self, state: InstanceState, error: str | None = None) -> None:
        if state is self.status.state:
            return
        previous, self.status.state = self.status.state, state
        self.status.last_error = error if error is not None else self.status.last_error
        if state is S.READY:
            self.status.ready_at = self._clock.wall()
        self._events.emit(self.name, "state_changed", instance=0, previous=str(previous), state=str(state))

    def start(self) -> None:
        """Resume routing and check the engine now, so `--wait` sees it ready without a request."""
        if self.status.state is S.STOPPED:
            self._set(S.UNAVAILABLE)
        if self.status.state is not S.READY and self._task_group is not None:
            self._task_group.start_soon(self._check)

    async def _check(self) -> None:
        try:
            await self.wait_ready(self.attach_wait)
        except EngineUnavailable:
            pass  # stays UNAVAILABLE; the next request checks again

    async def stop(self) -> None:
        self._set(S.STOPPED)

    async def wait_ready(self, timeout: float) -> str:
        if self.status.state is S.READY:
            return self.base_url
        with anyio.move_on_after(min(timeout, self.attach_wait)):
            while True:
                if await self.adapter.ready(self.base_url):
                    self._set(S.READY)
                    return self.base_url
                self._set(S.UNAVAILABLE, f"the attached engine at {self.base_url} does not answer")
                await anyio.sleep(0.25)
        raise EngineUnavailable(
            f"the attached engine of {self.name!r} at {self.base_url} did not answer its health check",
            model=self.name,
        )

    def engine_gone(self, launch: int) -> bool:
        """A broken connection to an attached engine: check it again on the next request."""
        self._set(S.UNAVAILABLE, f"lost the connection to the attached engine at {self.base_url}")
        return False
