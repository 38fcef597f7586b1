"""One instance's settlement: its ledger of cut requests, the engine readings that settle them, the events.

The chat path reports each cut request (``cut``). While one of them waits
for the engine's idle report, a task reads the engine's load every
``poll`` seconds and settles what each reading proves (``domain/settlement``);
the controller reports the engine's end (stop or restart) with
``engine_ended``, which settles everything. Events ``request_cut`` and
``request_settled`` carry the rule and the seconds, never a caller's ID.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import anyio

from capyctl.domain.ports import Clock, EngineLoad
from capyctl.domain.requests import RequestRecord
from capyctl.domain.settlement import ENGINE_IDLE, Ledger, Settled
from capyctl.services.events import Events


class Settlement:
    def __init__(
        self,
        name: str,
        index: int,
        read_load: Callable[[], Awaitable[EngineLoad | None]],
        clock: Clock,
        events: Events,
        poll: float = 0.1,
    ) -> None:
        self.ledger = Ledger()
        self._name = name
        self._index = index  # the instance whose cut requests these are
        self._read_load = read_load  # the engine's (running, waiting) counts; None when it cannot tell
        self._clock = clock
        self._events = events
        self._poll = poll
        self._task_group: anyio.abc.TaskGroup | None = None
        self._polling = False

    def bind(self, task_group: anyio.abc.TaskGroup) -> None:
        self._task_group = task_group

    def cut(self, record: RequestRecord) -> None:
        """A request this instance was working on was cut; it stays counted until evidence settles it."""
        entry = self.ledger.cut(record.id, record.answered, self._clock.monotonic())
        self._events.emit(self._name, "request_cut", instance=self._index, rule=entry.rule)
        if entry.rule == ENGINE_IDLE and not self._polling and self._task_group is not None:
            self._polling = True
            self._task_group.start_soon(self._read_until_idle)

    def engine_ended(self) -> None:
        """The engine process is gone (stopped, crashed, restarted): nothing it counted can still run."""
        self._report(self.ledger.engine_ended(self._clock.monotonic()))

    async def _read_until_idle(self) -> None:
        try:
            while self.ledger.waits_for_idle():
                taken_at = self._clock.monotonic()  # before the reading: only cuts before it can be settled
                load = await self._read_load()
                if load is not None:
                    self._report(self.ledger.reading(load[0], load[1], taken_at))
                if self.ledger.waits_for_idle():
                    await anyio.sleep(self._poll)
        finally:
            self._polling = False

    def _report(self, settled: list[Settled]) -> None:
        for entry in settled:
            self._events.emit(
                self._name, "request_settled", instance=self._index, rule=entry.rule, seconds=round(entry.seconds, 3)
            )
            self._events.settled(entry.request, entry.rule, entry.seconds)
