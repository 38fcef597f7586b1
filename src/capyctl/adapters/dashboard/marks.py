"""What the Charts page marks on a deployment's time axis: its parks, wakes, switches, and the stops that
made way (a park of a ``restart_only`` deployment, an idle stop, a victim of a switch), each an event of
its own: ``parked``, ``woken``, ``switch_completed``, ``gave_way``. An operator's plain stop is no mark."""

from __future__ import annotations

from typing import Any

import msgspec

MARKED = {"parked": "park", "woken": "wake", "switch_completed": "switch"}  # an event kind -> the mark it draws


class Mark(msgspec.Struct, frozen=True):
    at: float
    kind: str  # park, wake, switch or stop
    event: str  # the event's own kind
    detail: str


def words(detail: dict[str, Any]) -> str:
    """An event's fields as "key=value" words (as the Events page shows them)."""
    return " ".join(f"{k}={v}" for k, v in detail.items())


def mark_of(deployment: str | None, kind: str, detail: dict[str, Any], at: float) -> Mark | None:
    """The mark a deployment's stored event draws; None for most events (and for the server's own)."""
    if deployment is None:
        return None
    if kind == "gave_way":  # stopped to make way: a park it could not make, or a stop asked outright
        return Mark(at, "park" if detail.get("asked") == "park" else "stop", kind, f"stopped after {detail.get('why')}")
    if kind in MARKED:
        return Mark(at, MARKED[kind], kind, words(detail))
    return None
