"""What the Charts page marks on a deployment's time axis: its parks, wakes and switches, and the stops that
made room.

Most marks are events of their own: ``parked``, ``woken``, ``switch_completed``. Two ways of going leave
no such event: a park of a ``restart_only`` deployment stops its engine instead of parking it, and a
switch may stop a victim (of any residency) to free its device. Both show only as the victim's
``state_changed`` to ``stopped``, after what asked for it: an operator's or the idle timer's park
(``operator_park``, ``idle_park``), an idle stop (``idle_stop``), or a ``switch_planned`` naming it a
victim. ``Marker`` reads the events in the order they were stored, notes the reason a deployment was
asked to go, and marks its engine's stop with that reason; any other change of state (it parked, or is
ready again) or an operator's own stop or start forgets the reason, so a plain stop is never marked.
"""

from __future__ import annotations

from typing import Any

import msgspec

MARKED = {"parked": "park", "woken": "wake", "switch_completed": "switch"}  # an event kind -> the mark it draws
ASKED = {"operator_park": "park", "idle_park": "park", "idle_stop": "stop"}  # events that ask an engine to go
FORGET = frozenset({"operator_stop", "operator_start", "deployment_deleted"})  # an operator's word supersedes


class Mark(msgspec.Struct, frozen=True):
    at: float
    kind: str  # park, wake, switch or stop
    event: str  # the event's own kind
    detail: str


def words(detail: dict[str, Any]) -> str:
    """An event's fields as "key=value" words (as the Events page shows them)."""
    return " ".join(f"{k}={v}" for k, v in detail.items())


class Marker:
    """Turns a stream of stored events into marks, one deployment's pending reason at a time."""

    def __init__(self) -> None:
        self._asked: dict[str, tuple[str, str]] = {}  # deployment -> (the mark its stop draws, why it goes)

    def see(self, deployment: str | None, kind: str, detail: dict[str, Any], at: float) -> list[tuple[str, Mark]]:
        """The marks this event draws, each with its deployment's name (none for most events)."""
        if deployment is None:
            return []
        if kind in MARKED:
            if kind == "parked":
                self._asked.pop(deployment, None)
            return [(deployment, Mark(at, MARKED[kind], kind, words(detail)))]
        if kind in ASKED:
            self._asked[deployment] = (ASKED[kind], kind)
        elif kind == "switch_planned":
            for victim in detail.get("victims") or ():
                if isinstance(victim, dict) and isinstance(victim.get("name"), str):
                    self._asked[victim["name"]] = ("stop", f"a switch for {deployment}")
        elif kind in FORGET:
            self._asked.pop(deployment, None)
        elif kind == "state_changed" and detail.get("state") != "stopping":
            asked = self._asked.pop(deployment, None)
            if asked is not None and detail.get("state") == "stopped":
                return [(deployment, Mark(at, asked[0], kind, f"stopped after {asked[1]}"))]
        return []
