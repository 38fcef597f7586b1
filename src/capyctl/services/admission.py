"""The scheduler seam: the chat path asks ``admit`` and gets a lease, a wait or a refusal.

``Admission`` (domain) decides; this service owns it and acts: it wakes a
waiter when the domain grants it, starts a model a request waits for, and
turns refusals into errors carrying ``Retry-After``. A lease is held for the
whole engine call and returned when the ``admit`` context ends, however it
ends; returning it grants the next waiter at once.

``wait`` is the request's ``X-LLM-Wait``: None waits as long as the request
deadline allows (the request's watchdog cuts it then), 0 never waits (the
answer is at once ``model_loading`` or ``queued``, and a model that is not
running is started anyway), N waits at most N seconds, then answers the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import anyio

from capyctl.domain.errors import DeviceBusy, ModelLoading, Queued, QueueFull
from capyctl.domain.ports import Clock
from capyctl.domain.requests import RequestRecord
from capyctl.domain.scheduling import GRANTED, Admission, Loading, QueueLimits, Refused, Route, loading_retry_after


class Ready(Protocol):
    """What admission's grants look at: whether the deployment's engine is ready (the switchboard's
    ``Occupant`` tells it too, when it grants again after a switch)."""

    @property
    def ready(self) -> bool: ...


class Schedulable(Ready, Protocol):
    """What admission asks of a deployment's controller (a part of ``controllers.Serving``)."""

    def ask(self) -> None: ...
    async def route(self, timeout: float) -> Route: ...
    def loading(self) -> Loading: ...


class AdmissionService:
    def __init__(self, limits: QueueLimits, clock: Clock, ready_timeout: float = 1800.0) -> None:
        self.state = Admission(limits)
        self._clock = clock
        self._ready_timeout = ready_timeout  # the request deadline: a waiter is cut by then anyway
        self._wakers: dict[str, anyio.Event] = {}
        self._arrived: dict[str, float] = {}  # when each waiting request arrived (monotonic)
        self._held: set[str] = set()  # deployments that grant nothing now: they drain for a switch
        self.last_used: dict[str, float] = {}  # when a request last arrived for a deployment or left it
        self.on_wait: Callable[[str, float], None] = lambda deployment, seconds: None  # for metrics

    # --- what the switchboard asks and does ---------------------------------------------------
    def hold(self, name: str) -> None:
        """Grant nothing more to ``name`` (its drain before a switch); arrivals wait in its queue."""
        self._held.add(name)

    def unhold(self, name: str, runner: Ready) -> None:
        """Grant again (the switch is over); its waiters look again at once."""
        self._held.discard(name)
        self._wake(name, runner)
        for waiting in self.state.queued(name):
            waker = self._wakers.get(waiting)
            if waker is not None:
                waker.set()

    def oldest_waiting(self, name: str) -> float | None:
        """When the request that has waited longest for ``name`` arrived, None when nobody waits."""
        queued = self.state.queued(name)
        return self._arrived.get(queued[0]) if queued else None

    def _open(self, name: str, runner: Ready) -> bool:
        return runner.ready and name not in self._held

    def admit(self, runner: Schedulable, record: RequestRecord, wait: float | None) -> Lease:
        """``async with`` it: entered once granted (after a wait in line, if need be), or raising the
        refusal; the lease is returned when the block ends, however it ends."""
        return Lease(self, runner, record, wait)

    def admit_now(self, runner: Schedulable, record: RequestRecord) -> Lease | None:
        """The lease ``admit`` would grant without waiting, granted now (an entered ``Lease``: its ``async with``
        only returns it), when the deployment is open and a place is free with nobody in line; None, with
        nothing changed, otherwise (``admit`` then decides)."""
        name = record.deployment
        if not self._open(name, runner) or not self.state.grants_at_once(name):
            return None
        self.last_used[name] = began = self._clock.monotonic()
        self.state.arrive(name, record.id, True)
        return Lease(self, runner, record, None, began)

    async def _enter(self, runner: Schedulable, record: RequestRecord, wait: float | None) -> float:
        """Admit ``record``; the monotonic time its lease began."""
        name = record.deployment
        self.last_used[name] = self._clock.monotonic()
        decision = self.state.arrive(name, record.id, self._open(name, runner))
        if decision != GRANTED:
            if isinstance(decision, Refused):
                if not runner.ready and decision.code == "queue_full":
                    runner.ask()  # nobody may wait, but the model is still started for the next try
                    if self.state.limits.max_pending_per_deployment == 0:
                        raise self._not_waiting(runner, name, record.id)
                raise self._refusal(decision, name)
            arrived = self._clock.monotonic()
            try:
                await self._wait(runner, record, wait)
            finally:  # (a wait that ended in a refusal is a wait too, for the request's record)
                record.waited = self._clock.monotonic() - arrived
            self.on_wait(name, record.waited)
        return self._clock.monotonic()

    def _leave(self, runner: Schedulable, name: str, began: float) -> None:
        """A lease returned: the next waiter is granted at once."""
        self.last_used[name] = now = self._clock.monotonic()
        self.state.release(name, now - began)
        self._wake(name, runner)

    async def _wait(self, runner: Schedulable, record: RequestRecord, wait: float | None) -> None:
        """Wait in line until granted; leaves the line (and re-raises) on any way out but a grant."""
        name, me = record.deployment, record.id
        waker = self._wakers[me] = anyio.Event()
        self._arrived[me] = self._clock.monotonic()
        try:
            if wait == 0:
                if not runner.ready:
                    runner.ask()
                raise self._not_waiting(runner, name, me)
            with anyio.move_on_after(wait):  # None: no bound here
                while self.state.position(name, me) is not None:
                    if not runner.ready:
                        await runner.route(self._ready_timeout)  # asks for a start when it is not running
                        self._wake(name, runner)
                    else:
                        with anyio.move_on_after(1.0):  # also look again: the engine may have gone and come back
                            await waker.wait()
                        if waker.is_set():
                            waker = self._wakers[me] = anyio.Event()
                        self._wake(name, runner)
                return
            raise self._not_waiting(runner, name, me)
        except BaseException:
            if not self.state.leave(name, me):  # granted just before this way out: give the slot back
                self.state.release(name, None)
                self._wake(name, runner)
            raise
        finally:
            del self._wakers[me], self._arrived[me]

    def _wake(self, name: str, runner: Ready) -> None:
        for granted in self.state.grants(name, self._open(name, runner)):
            waker = self._wakers.get(granted)
            if waker is not None:
                waker.set()

    def _not_waiting(self, runner: Schedulable, name: str, me: str) -> Exception:
        """The answer for a request that will not wait (longer): model_loading or queued, with Retry-After."""
        if not runner.ready:
            loading = runner.loading()
            return ModelLoading(name, loading.state, loading_retry_after(loading.cold_starts, loading.starting_for))
        position = self.state.position(name, me) or 1
        reason = f"{self.state.in_flight(name)} requests at the engine, its limit"
        return Queued(name, position, reason, self.state.retry_after(name, position))

    def _refusal(self, refused: Refused, name: str) -> Exception:
        limits = self.state.limits
        if refused.code == "device_busy":
            return DeviceBusy(limits.max_open, self.state.retry_after(name, 1))
        if self.state.waiting(name) >= limits.max_pending_per_deployment:
            reason = f"{self.state.waiting(name)} waiting, the limit queue.max_pending_per_deployment"
        else:
            reason = f"{self.state.pending} waiting over all models, the limit queue.max_pending_total"
        return QueueFull(name, reason, self.state.retry_after(name))


class Lease:
    """``AdmissionService.admit``'s context: a class rather than a generator, as it is entered and left
    once per request on the relay's path."""

    __slots__ = ("_service", "_runner", "_record", "_wait", "_began")

    def __init__(
        self,
        service: AdmissionService,
        runner: Schedulable,
        record: RequestRecord,
        wait: float | None,
        began: float | None = None,
    ) -> None:
        self._service, self._runner, self._record, self._wait = service, runner, record, wait
        self._began = began  # when it was granted; None until then

    async def __aenter__(self) -> None:
        if self._began is None:  # (one from admit_now was granted already)
            self._began = await self._service._enter(self._runner, self._record, self._wait)

    async def __aexit__(self, *_: object) -> None:
        self.give_back()

    def give_back(self) -> None:
        """Return the granted lease (what leaving its ``async with`` does)."""
        assert self._began is not None
        self._service._leave(self._runner, self._record.deployment, self._began)
