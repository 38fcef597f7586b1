"""Settlement of cut requests (CAN-2, CAN-4): what an instance still counts after a request was cut.

Closing the engine connection asks the engine to stop; it does not prove it
did. So a cut request stays counted against its instance until evidence:

- ``engine_idle``: the engine had answered (text, reasoning or an error; a
  role-only chunk does not count). It is settled by the engine's first
  report of 0 running and 0 waiting requests *taken after the cut* (a
  reading started before the cut proves nothing about it).
- ``engine_stop``: the engine had not answered, so it may not have started
  the request yet and could still run it after reporting itself idle. Only
  the instance's next stop or restart settles it.

Pure: times are passed in (the ``Clock`` port's monotonic seconds).
"""

from __future__ import annotations

from typing import TypedDict

import msgspec

ENGINE_IDLE = "engine_idle"
ENGINE_STOP = "engine_stop"


def rule_for(answered: bool) -> str:
    """What settles a cut request: the engine's idle report once it had answered, else its stop."""
    return ENGINE_IDLE if answered else ENGINE_STOP


class RuleCount(TypedDict):
    """One rule's unsettled cut requests, as ``counts`` lists them."""

    rule: str
    count: int


class Cut(msgspec.Struct, frozen=True):
    request: str
    rule: str
    at: float


class Settled(msgspec.Struct, frozen=True):
    request: str
    rule: str
    seconds: float  # from the cut to the evidence


class Ledger:
    """One instance's unsettled cut requests."""

    def __init__(self) -> None:
        self._cuts: list[Cut] = []

    def cut(self, request: str, answered: bool, at: float) -> Cut:
        entry = Cut(request, rule_for(answered), at)
        self._cuts.append(entry)
        return entry

    def reading(self, running: int, waiting: int, taken_at: float) -> list[Settled]:
        """The engine reported its load, in a reading started at ``taken_at``: settle what it proves."""
        if running or waiting:
            return []
        settled = [c for c in self._cuts if c.rule == ENGINE_IDLE and c.at < taken_at]
        self._cuts = [c for c in self._cuts if c not in settled]
        return [Settled(c.request, c.rule, taken_at - c.at) for c in settled]

    def engine_ended(self, at: float) -> list[Settled]:
        """The instance's engine stopped or restarted: every cut request it counted is settled."""
        settled, self._cuts = self._cuts, []
        return [Settled(c.request, c.rule, at - c.at) for c in settled]

    def waits_for_idle(self) -> bool:
        return any(c.rule == ENGINE_IDLE for c in self._cuts)

    def counts(self) -> list[RuleCount]:
        """Per rule, how many are unsettled: ``[{"rule": ..., "count": N}]`` (rules with none left out)."""
        out: list[RuleCount] = []
        for rule in (ENGINE_IDLE, ENGINE_STOP):
            n = sum(1 for c in self._cuts if c.rule == rule)
            if n:
                out.append(RuleCount(rule=rule, count=n))
        return out
