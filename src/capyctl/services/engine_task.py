"""A managed controller's task: it brings about the desired state, acting only through ``EngineEffects``.

With no engine running it follows ``next_step`` (launch, fail, show
stopped, rest); with one running, ``watch_step`` (park, wake, watch). One
launch runs one engine to its end: room on its device first (``Room``), then
the engine, its readiness, and, for a residency that parks, the canary's
answer to compare after each wake. Whatever ends a launch (a stop, a crash,
a failed start, a fault of CapyCTL's) ends its engine under a shield, and
only then are its memory and its cut requests released: the evidence is the
engine's end, never a timer.
"""

from __future__ import annotations

import logging

import anyio

from capyctl.domain.deployments import Desired, InstanceState, Step, next_step, restart_delay
from capyctl.domain.errors import CapyError, EngineUnavailable, GpuBusy, InsufficientMemory
from capyctl.domain.lifecycle import Launched, Watch, ending_state, failures_after, keep_last, wake_matches, watch_step
from capyctl.domain.memory import Residency
from capyctl.domain.ports import Clock, EngineEffects
from capyctl.services.controller_base import ControllerSettings, Room
from capyctl.services.events import Events
from capyctl.services.managed_state import ManagedState
from capyctl.services.settling import Settlement
from capyctl.services.switching import Occupant

log = logging.getLogger("capyctl.controller")
S = InstanceState
CANARY_WAIT = 120.0  # seconds the canary may take before the engine counts as not answering
# seconds between two looks at a serving engine whose exits its effects tell (``EngineEffects.watch_exits``):
# the news wakes the watch; the look is only a backstop, rare so that thousands of instances cost little
EXITS_TOLD_LOOK = 10.0


ENDED_BY = {  # the words for ``EngineEffects.ended_by``'s causes
    "agent_stopped": "its host's agent was stopped, and stopped its engines",
    "host_revoked": "its host was revoked",
    "not_on_host": "its host came back without it (its agent was restarted, or killed)",
}


class EngineTask:
    def __init__(
        self,
        occupant: Occupant,
        state: ManagedState,
        effects: EngineEffects,
        room: Room,
        clock: Clock,
        events: Events,
        settings: ControllerSettings,
        settlement: Settlement,
    ) -> None:
        self._occupant = occupant  # the controller, as its room on its device is claimed for
        self._state = state
        self._effects = effects
        self._room = room
        self._clock = clock
        self._events = events
        self._settings = settings
        self._settlement = settlement
        self._name = occupant.name
        self._reference: str | None = None  # this launch's canary answer, at its first readiness
        # An engine whose exits are told (a host's) wakes the watch itself; a child process here is looked at
        self._look_every = EXITS_TOLD_LOOK if effects.watch_exits(state.notify) else settings.poll_interval

    async def run(self, scope: anyio.CancelScope, finished: anyio.Event) -> None:
        """Reconcile until the deployment is closed or CapyCTL shuts down: then no engine is left."""
        state = self._state
        try:
            with scope:
                while True:
                    try:
                        await self.step()
                    except Exception as exc:  # one deployment's fault must not end the others
                        log.exception("the controller of %s met an unexpected error", self._name)
                        state.status.last_error = f"CapyCTL's controller failed: {type(exc).__name__}: {exc}"
                        self._events.emit(
                            self._name,
                            "controller_failed",
                            instance=self._state.status.index,
                            reason=state.status.last_error,
                        )
                        state.failures, state.relaunch = self._settings.max_start_failures, False
                        state.status.state = S.FAILED  # no engine runs here (launches end theirs): FAILED until
                        state.notify()  # an operator's start; what requests wait for is told at once
                        await state.changed()  # and nothing is tried again before a command
        finally:
            state.to_stopped()  # the launch's own cleanup has ended the engine
            finished.set()
            state.notify()

    async def step(self) -> None:
        state = self._state
        step = next_step(state.desired, state.status.state, state.failures, self._settings.max_start_failures)
        if step is Step.LAUNCH:
            await self._launch()
        elif step is Step.FAIL:
            state.set(S.FAILED)
        elif step is Step.SETTLE:
            state.to_stopped()
        else:
            await state.changed()

    async def _launch(self) -> None:
        """One launch, after the backoff its failures call for; a change of the desired state cancels it."""
        state = self._state
        with anyio.CancelScope() as scope:
            state.launch_scope = scope
            if state.status.state is not S.STARTING:
                state.set(S.STARTING)
            if state.relaunch and self._blameless() is None:  # (ended by its host's going: no backoff, the launch
                delay = restart_delay(state.failures or 1)  # waits for the host to be back)
                self._events.emit(self._name, "engine_restarting", instance=self._state.status.index, after_s=delay)
                await anyio.sleep(delay)
                state.status.restarts += 1
            try:
                ready_for = await self._launch_once()
            except (InsufficientMemory, GpuBusy) as refusal:  # no room: the requests that asked are told
                state.status.last_error = refusal.message
                state.refuse(refusal, Desired.ON_DEMAND)
                state.to_stopped()
                return
            except Exception as exc:  # a launch that broke (no log folder, a failed fork ...)
                # is a failed start, after the launch's own cleanup ended its engine: backoff, then FAILED
                log.exception("the launch of %s's engine failed", self._name)
                state.status.last_error = f"could not launch the engine: {type(exc).__name__}: {exc}"
                self._events.emit(
                    self._name, "engine_start_failed", instance=self._state.status.index, reason=state.status.last_error
                )
                ready_for = None
            state.failures = failures_after(state.failures, ready_for, self._settings.stable_after, self._blameless())
            state.relaunch = True
        state.launch_scope = None
        if scope.cancelled_caught:  # stopped on purpose: the next start is a fresh one
            state.failures, state.relaunch = 0, False
            state.to_stopped()

    async def _launch_once(self) -> float | None:
        """Run one engine to its end; the seconds it was ready, None if it never was."""
        await self._room.claim(self._occupant)
        try:
            return await self._run_engine()
        finally:
            self._state.holds = self._state.wake_granted = False  # its engine is gone (or never began): freed
            self._state.notify()

    async def _run_engine(self) -> float | None:
        state = self._state
        state.launch += 1
        state.status.started_at = self._clock.wall()
        engine = await self._effects.launch(state.launch)
        state.latest, state.engine = engine.address, engine
        state.status.port, state.status.log_path, state.status.pid = engine.port, engine.log_path, engine.pid
        state.status.ingress_port = engine.ingress_port
        self._events.emit(
            self._name,
            "engine_adopted" if engine.adopted else "engine_started",
            instance=self._state.status.index,
            pid=engine.pid,
            port=engine.port,
        )
        cancelled = False
        try:
            if not await self._until_ready(engine):
                return None
            self._reference = await self._first_answer(engine) if self._parks else None
            state.set(S.READY)
            state.ended_by = None  # a later engine serves: how an earlier one ended is no news any more
            ready_at = self._clock.monotonic()
            code = await self._watch(engine)
            cause = self._ended(engine)
            if cause is None:  # by itself: a crash
                state.status.last_error = f"engine exited with status {code} while serving"
                self._events.emit(
                    self._name, "engine_crashed", instance=self._state.status.index, status=code, log=engine.log_path
                )
            else:  # not the engine's doing: said as what it was, and started again once its machine allows
                state.status.last_error = f"engine ended while serving: {ENDED_BY.get(cause, cause)}"
                self._events.emit(
                    self._name, "engine_ended", instance=self._state.status.index, cause=cause, status=code
                )
            state.set(S.STARTING)  # at once: no request may be routed to the dead engine
            return self._clock.monotonic() - ready_at
        except anyio.get_cancelled_exc_class():
            cancelled = True
            raise
        finally:
            with anyio.CancelScope(shield=True):
                await self._end(engine, cancelled)

    async def _watch(self, engine: Launched) -> int:
        """Park and wake the engine as wanted until it exits; its exit status."""
        while (code := self._effects.exited(engine)) is None:
            step = watch_step(self._state.desired, self._state.status.state)
            if step is Watch.PARK:
                await self._park(engine)
            elif step is Watch.WAKE:
                await self._wake(engine)
            else:
                with anyio.move_on_after(self._look_every):
                    await self._state.changed()
        return code

    async def _end(self, engine: Launched, cancelled: bool) -> None:
        """End the engine (called shielded); once it is gone, what it counted is settled."""
        state = self._state
        if self._effects.exited(engine) is None:
            shown = ending_state(state.status.state, cancelled)
            if shown is not None:
                state.set(shown)
        await self._effects.stop(engine, self._settings.stop_grace)
        state.status.pid, state.engine = None, None
        if self._effects.exited(engine) is not None:  # not an engine a stopping server left running on a host
            self._settlement.engine_ended()
        state.notify()

    async def _until_ready(self, engine: Launched) -> bool:
        status = self._state.status
        deadline = self._clock.monotonic() + self._settings.startup_timeout
        while self._clock.monotonic() < deadline:
            if (code := self._effects.exited(engine)) is not None:
                cause = self._ended(engine)
                status.last_error = (
                    f"engine exited with status {code} while starting"
                    if cause is None
                    else f"engine ended while starting: {ENDED_BY.get(cause, cause)}"
                )
                self._events.emit(
                    self._name,
                    "engine_start_failed",
                    instance=self._state.status.index,
                    status=code,
                    **({"cause": cause} if cause is not None else {}),
                )
                return False
            if await self._effects.ready(engine):
                return True
            await anyio.sleep(self._settings.ready_poll)
        with anyio.CancelScope(shield=True):
            await self._effects.stop(engine, self._settings.stop_grace)
        status.last_error = f"engine not ready after {self._settings.startup_timeout:.0f} s"
        self._events.emit(
            self._name, "engine_start_failed", instance=self._state.status.index, reason="startup timeout"
        )
        return False

    def _ended(self, engine: Launched) -> str | None:
        """Why ``engine``, gone, ended when it was not by itself (kept with its launch for ``lost`` and the
        backoff); None for a crash."""
        cause = self._effects.ended_by(engine)
        if cause is not None:
            self._state.ended_by = (engine.number, cause)
        return cause

    def _blameless(self) -> str | None:
        """Why the latest launch's engine ended, when that was not its own doing (no failure, no backoff)."""
        ended = self._state.ended_by
        return ended[1] if ended is not None and ended[0] == self._state.launch else None

    @property
    def _parks(self) -> bool:
        return self._occupant.spec.residency is not Residency.RESTART_ONLY

    async def _park(self, engine: Launched) -> None:
        """Sleep (the switchboard drained it first); a park the engine does not confirm becomes a stop."""
        began = self._clock.monotonic()
        self._state.set(S.PARKING)
        try:
            await self._effects.park(engine)
            confirmed = await self._effects.parked(engine)
            why = "the engine still says it is awake"
        except CapyError as exc:
            confirmed, why = False, exc.message
        if confirmed is False:  # None: the engine cannot tell, and its answer to the park is the evidence
            error = f"the engine did not park ({why}); stopped instead"
            self._events.emit(self._name, "park_failed", instance=self._state.status.index, reason=error)
            self._give_up(error)
            return
        self._state.set(S.PARKED)
        self._events.emit(
            self._name,
            "parked",
            instance=self._state.status.index,
            residency=str(self._occupant.spec.residency),
            seconds=round(self._clock.monotonic() - began, 3),
        )

    async def _wake(self, engine: Launched) -> None:
        """Room for the awake footprint, the engine's wake, then the canary: a woken engine must answer its
        fixed request as it did before it parked, or it is stopped (the next request starts it afresh)."""
        state = self._state
        state.wake_began = began = self._clock.monotonic()
        try:
            await self._room.claim(self._occupant)
        except (InsufficientMemory, GpuBusy) as refusal:  # it stays parked; the requests that asked are told
            state.refuse(refusal, Desired.PARK)
            return
        state.set(S.WAKING)
        try:
            await self._effects.wake(engine)
            if await self._effects.parked(engine):
                raise EngineUnavailable("the engine still says it is asleep after its wake", model=self._name)
            answer = await self._ask_canary(engine)
        except CapyError as exc:
            error = f"the engine did not wake: {exc.message}"
            self._events.emit(self._name, "wake_failed", instance=self._state.status.index, reason=error)
            self._give_up(error)
            return
        if not wake_matches(self._reference, answer):
            self._events.emit(
                self._name, "wake_mismatch", instance=self._state.status.index, expected=self._reference, got=answer
            )
            self._give_up(
                f"wake_mismatch: after its wake the engine answered {answer!r} to the canary, "
                f"not {self._reference!r} as before it parked"
            )
            return
        state.wake_granted = False
        seconds = self._clock.monotonic() - began
        state.status.wake_times = keep_last(state.status.wake_times, seconds)
        state.measured()
        state.set(S.READY)
        self._events.emit(self._name, "woken", instance=self._state.status.index, seconds=round(seconds, 3))

    def _give_up(self, error: str) -> None:
        """Stop this engine (not stickily): a failed park or wake frees its memory by the process's end."""
        self._state.status.last_error = error
        self._state.desire(Desired.ON_DEMAND)

    async def _first_answer(self, engine: Launched) -> str | None:
        """The canary's answer at this launch's first readiness, kept to compare after each wake."""
        try:
            return await self._ask_canary(engine)
        except CapyError as exc:
            self._events.emit(self._name, "canary_unanswered", instance=self._state.status.index, reason=exc.message)
            return None  # nothing to compare with: wakes of this launch are not checked

    async def _ask_canary(self, engine: Launched) -> str | None:
        try:
            with anyio.fail_after(CANARY_WAIT):
                return await self._effects.canary(engine)
        except TimeoutError as exc:
            raise EngineUnavailable(
                f"the canary request got no answer within {CANARY_WAIT:.0f} s", model=self._name
            ) from exc
