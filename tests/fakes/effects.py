"""A fake ``EngineEffects`` with observable state: what the controller did, in order, and each engine's state.

``done`` records each effect as "<what> <launch>" ("launch 1", "park 1",
"stop 1" ...). The test sets how the engines behave (``healthy``, ``parks``,
``answers``) and may hold a stop open with ``stop_gate`` to look at the
controller while an engine ends. ``changed`` is set (and replaced) at each
effect, each engine exit and each ``notify`` (a test may have the
controller's events call it), so a test waits on conditions, not on time.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio

from capyctl.domain.errors import CapyError
from capyctl.domain.lifecycle import EngineAddress, Launched
from capyctl.domain.ports import EngineLoad


class FakeEngineEffects:
    def __init__(self) -> None:
        self.done: list[str] = []
        self.codes: dict[int, int | None] = {}  # launch -> exit status, None while it runs
        self.causes: dict[int, str] = {}  # launch -> why it ended, when not by itself (``ended_by``)
        self.asleep: dict[int, bool] = {}
        self.healthy = True  # what every readiness probe answers
        self.parks: bool | None = True  # the engine's word after a park: sleeps, still awake, cannot tell
        self.answers: list[str] = []  # the canary's answers, in order; "ready" once they run out
        self.launch_error: Exception | None = None  # raised by the next launch
        self.stop_gate: anyio.Event | None = None  # while set to an unset event, a stop waits for it
        self.launch_gate: anyio.Event | None = None  # likewise a launch (a host's waits for its host to be back)
        self.load_now: EngineLoad | None = EngineLoad(0, 0)  # what each load reading answers
        self.loads: list[int] = []  # the launch each load reading was of
        self.unreachable: CapyError | None = None  # what ``offline`` says: the engine's machine is out of reach
        self.changed = anyio.Event()

    def _did(self, what: str, engine: int) -> None:
        self.done.append(f"{what} {engine}")
        self.notify()

    def notify(self) -> None:
        self.changed.set()
        self.changed = anyio.Event()

    def running(self) -> list[int]:
        return [n for n, code in self.codes.items() if code is None]

    def crash(self, launch: int, code: int = -9, cause: str | None = None) -> None:
        self.codes[launch] = code
        if cause is not None:
            self.causes[launch] = cause
        self.notify()

    # --- the port ----------------------------------------------------------------------------
    async def launch(self, number: int) -> Launched:
        if self.launch_gate is not None:
            await self.launch_gate.wait()
        if self.launch_error is not None:
            error, self.launch_error = self.launch_error, None
            raise error
        self.codes[number], self.asleep[number] = None, False
        self._did("launch", number)
        return Launched(
            number=number,
            address=EngineAddress(f"http://engine-{number}"),
            pid=100 + number,
            port=None,
            log_path=f"/logs/{number}.log",
        )

    def watch_exits(self, told: Callable[[], None]) -> bool:
        return False  # the tests set ``codes``: the controller looks

    def exited(self, engine: Launched) -> int | None:
        return self.codes[engine.number]

    def ended_by(self, engine: Launched) -> str | None:
        return self.causes.get(engine.number) if self.codes[engine.number] is not None else None

    async def ready(self, engine: Launched) -> bool:
        return self.healthy

    async def stop(self, engine: Launched, grace: float) -> int:
        self._did("stop", engine.number)
        if self.stop_gate is not None:
            await self.stop_gate.wait()
        code = self.codes[engine.number]
        if code is None:
            self.codes[engine.number] = code = -15
            self.notify()
        return code

    async def park(self, engine: Launched) -> None:
        self._did("park", engine.number)
        self.asleep[engine.number] = self.parks is not False

    async def wake(self, engine: Launched) -> None:
        self._did("wake", engine.number)
        self.asleep[engine.number] = False

    async def parked(self, engine: Launched) -> bool | None:
        return None if self.parks is None else self.asleep[engine.number]

    async def canary(self, engine: Launched) -> str | None:
        self._did("canary", engine.number)
        return self.answers.pop(0) if self.answers else "ready"

    async def load(self, engine: Launched) -> EngineLoad | None:
        self.loads.append(engine.number)
        self.notify()
        return self.load_now

    def offline(self) -> CapyError | None:
        return self.unreachable

    host = None  # this machine

    async def reprove(self) -> None:
        """(on this machine: nothing to prove)"""

    def leave(self) -> None:
        """(on this machine: nothing to leave)"""
