"""The state of a managed deployment's instance, shared by its controller and the controller's task.

Both run on one event loop, so plain fields suffice. Every change of ``status.state`` goes
through ``set``, and so through the transition table; every change that
someone may wait for ends with ``notify``, which wakes whoever awaits
``changed``.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio

from capyctl.domain.deployments import Deployment, Desired, InstanceState
from capyctl.domain.errors import CapyError
from capyctl.domain.lifecycle import EngineAddress, Launched, OnDesire, keep_last, on_desire, stop_path
from capyctl.domain.ports import Clock
from capyctl.services.controller_base import InstanceStatus, initial_desire, move
from capyctl.services.events import Events

S = InstanceState
_NOWHERE = EngineAddress("")  # no launch yet


class ManagedState:
    def __init__(
        self,
        deployment: Deployment,
        clock: Clock,
        events: Events,
        keep: Callable[[Deployment], None],
        index: int,
    ) -> None:
        self.deployment = deployment
        self._clock = clock
        self._events = events
        self._keep = keep  # stores the deployment record (its measured times)
        self.desired = initial_desire(deployment)
        self.status = InstanceStatus(
            index=index, cold_starts=list(deployment.cold_starts), wake_times=list(deployment.wake_times)
        )
        self.launch = 0  # the latest launch's number
        self.latest = _NOWHERE  # the latest launch's address
        self.engine: Launched | None = None  # the latest launch, while its engine may run
        self.address = _NOWHERE  # where requests go: the address of the launch that became ready
        self.failures = 0  # launches in a row that never became stable
        self.relaunch = False  # the last launch ended by itself: the next one comes after a backoff
        self.ended_by: tuple[int, str] | None = None  # (a launch, why its engine ended) when not by itself, until
        # a later launch is ready
        self.asks = 0  # starts asked for (by requests or an operator); a refusal answers one of them
        self.refused: tuple[int, CapyError] | None = None  # (the ask it answers, why)
        self.holds = False  # granted room on its device, until its engine process is gone
        self.wake_granted = False  # a parked engine was granted room for its awake footprint
        self.wake_began: float | None = None
        self.launch_scope: anyio.CancelScope | None = None  # the launch under way, which a stop cancels
        self.finished: anyio.Event | None = None  # set once the controller's task has ended
        self._changed = anyio.Event()  # set (and replaced) whenever the state or the desired state changes

    @property
    def name(self) -> str:
        return self.deployment.spec.name

    async def changed(self) -> None:
        """Returns at the next ``notify``."""
        await self._changed.wait()

    def notify(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def done(self) -> bool:
        return self.finished is not None and self.finished.is_set()

    def set(self, state: InstanceState) -> None:
        if state is S.READY:
            self.address = self.latest
        move(self.status, state, self.name, self._clock, self._events)
        if state is S.READY and self.status.started_at is not None and self.status.ready_at is not None:
            self.status.cold_starts = keep_last(self.status.cold_starts, self.status.ready_at - self.status.started_at)
            self.measured()
        self.notify()

    def desire(self, desired: Desired) -> None:
        self.desired = desired
        action = on_desire(desired, self.status.state, self.launch_scope is not None)
        if action is OnDesire.START:
            self.set(S.STARTING)
        elif action is OnDesire.CANCEL and self.launch_scope is not None:
            self.launch_scope.cancel()  # the launch's cleanup ends the engine
        self.notify()

    def refuse(self, refusal: CapyError, desired: Desired) -> None:
        """No room on its device: the requests that asked so far are told ``refusal``; nothing is launched or
        woken for them."""
        self.refused = (self.asks, refusal)
        self.desired = desired
        self.notify()

    def to_stopped(self) -> None:
        """No engine runs: show STOPPED (a FAILED deployment stays FAILED unless it is no longer wanted)."""
        for state in stop_path(self.status.state, self.desired):
            self.set(state)

    def measured(self) -> None:
        """Keep the measured start and wake times with the deployment, so they outlive CapyCTL's restarts."""
        self.deployment.cold_starts = self.status.cold_starts
        self.deployment.wake_times = self.status.wake_times
        self._keep(self.deployment)
