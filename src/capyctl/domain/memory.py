"""Memory on a device: what each deployment holds there, and the switch that makes room (LIFE-3, LIFE-5, CAN-3).

Pure rules over a snapshot; sizes in bytes, times passed in (seconds on a
monotonic clock).

What a deployment holds is read from evidence, never hoped for
(``Holding``): an engine process that runs holds its whole awake footprint,
whether it is starting, serving, parking or stopping; a parked one holds its
parked footprint only once the engine confirmed it sleeps; only a process
that is gone holds nothing. A charge CapyCTL cannot move (a park the engine
refused, an engine that would not stop) is ``pinned``.

A request for a model that does not fit plans a switch (``plan``):

- victims are models that nobody waits for, that CapyCTL may move now (ready
  or parked, not in a transition), least recently used first, the smallest
  set that makes room;
- a victim parks when the device still has room with its parked footprint,
  otherwise it stops; a model whose residency is ``restart_only``, or that
  still counts requests cut before any output (CAN-3), stops;
- a model that cannot fit even with every movable model gone is refused at
  once (``NeverFits``, 503 ``insufficient_memory``), never evicted for in a loop.

Each victim keeps admitting its own traffic for an admission window that
never resets and closes early when the victim is idle; then it drains,
bounded by the drain timeout (``gate``). Waiting models are switched in, one
switch per device at a time, oldest waiting request first (``next_in_line``);
one switch serves every request waiting for its model.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Mapping, Sequence

import msgspec


class Residency(enum.StrEnum):
    """How a deployment parks (LIFE-2)."""

    HOST_BACKED = "host_backed"  # weights kept in host RAM while the device is freed
    DEEP = "deep"  # weights dropped, reloaded from disk on wake
    RESTART_ONLY = "restart_only"  # parking stops the engine; waking starts it


class Device(msgspec.Struct, frozen=True, kw_only=True):
    name: str
    capacity: int  # bytes
    reserve: int = 0  # bytes CapyCTL never hands out (the driver, other programs)

    @property
    def usable(self) -> int:
        return max(0, self.capacity - self.reserve)


class Holding(enum.StrEnum):
    NONE = "none"  # no engine process: it is gone (the evidence that frees its memory)
    AWAKE = "awake"  # an engine process runs: its whole footprint, whatever it is doing
    PARKED = "parked"  # the engine confirmed it sleeps: its parked footprint


class Resident(msgspec.Struct, frozen=True, kw_only=True):
    """One deployment on a device, as the switch planner sees it."""

    name: str
    memory: int  # awake footprint, bytes
    parked_memory: int = 0  # what stays on the device while parked
    residency: Residency = Residency.RESTART_ONLY
    holding: Holding = Holding.NONE
    movable: bool = True  # ready or parked, in no transition: CapyCTL may park or stop it now
    pinned: bool = False  # a charge CapyCTL cannot move (a refused park, an engine that would not stop)
    waiting: int = 0  # requests waiting for it
    last_used: float = 0.0  # when a request last arrived for it or left it
    unsettled_before_output: int = 0  # cut requests the engine may still run (settle at its stop)

    @property
    def charged(self) -> int:
        if self.holding is Holding.AWAKE:
            return self.memory
        if self.holding is Holding.PARKED:
            return self.parked_memory
        return 0

    @property
    def can_park(self) -> bool:
        return self.residency is not Residency.RESTART_ONLY and self.unsettled_before_output == 0


def charged(residents: Sequence[Resident]) -> int:
    return sum(r.charged for r in residents)


class Fits(msgspec.Struct, frozen=True):
    free: int  # bytes left after the model is charged


class Victim(msgspec.Struct, frozen=True):
    name: str
    action: str  # "park" | "stop"
    frees: int  # bytes the action gives back


class SwitchPlan(msgspec.Struct, frozen=True, kw_only=True):
    target: str
    needed: int  # bytes missing before the victims move
    victims: tuple[Victim, ...]

    def describe(self) -> dict[str, object]:
        return {
            "target": self.target,
            "needed_bytes": self.needed,
            "victims": [{"name": v.name, "action": v.action, "frees_bytes": v.frees} for v in self.victims],
        }


class NeverFits(msgspec.Struct, frozen=True):
    reason: str


class NotNow(msgspec.Struct, frozen=True):
    """It could fit, but what holds the room cannot be moved now (requests wait for it, or it is in a
    transition); the request waits and the plan is made again when that changes."""

    reason: str


def gib(size: int) -> str:
    return f"{size / 2**30:.2f} GiB"


def plan(device: Device, target: Resident, others: Sequence[Resident]) -> Fits | SwitchPlan | NeverFits | NotNow:
    """What it takes to run ``target`` (awake) on ``device`` beside ``others``."""
    free = device.usable - charged(others) - target.charged
    needed = target.memory - target.charged - free
    if needed <= 0:
        return Fits(-needed)
    pinned = [r for r in others if r.pinned and r.charged]
    room = device.usable - sum(r.charged for r in pinned)
    if target.memory > room:
        held = ", ".join(f"{r.name} {gib(r.charged)}" for r in pinned) or "nothing"
        return NeverFits(
            f"{target.name} needs {gib(target.memory)}; device {device.name} has {gib(device.capacity)} "
            f"with {gib(device.reserve)} reserved, and CapyCTL cannot free what is pinned: {held}"
        )
    candidates = [r for r in others if r.charged and r.movable and not r.pinned and r.waiting == 0]
    chosen = _smallest_lru_set(candidates, needed)
    if chosen is None:
        busy = [r.name for r in others if r.charged and not r.pinned and r not in candidates]
        return NotNow(
            f"{target.name} needs {gib(needed)} more on {device.name}; what holds it cannot move now "
            f"({', '.join(busy)}: requests wait for them, or they are changing state)"
        )
    return SwitchPlan(target=target.name, needed=needed, victims=_park_or_stop(chosen, needed))


_EXHAUSTIVE = 12  # candidates up to which every set is tried; past it, least recently used first


def _smallest_lru_set(candidates: list[Resident], needed: int) -> list[Resident] | None:
    by_age = sorted(candidates, key=lambda r: r.last_used)  # least recently used first
    if sum(r.charged for r in by_age) < needed:
        return None
    if len(by_age) > _EXHAUSTIVE:
        chosen, freed = [], 0
        for r in by_age:
            chosen.append(r)
            freed += r.charged
            if freed >= needed:
                return chosen
    for size in range(1, len(by_age) + 1):
        sets = [list(s) for s in itertools.combinations(by_age, size) if sum(r.charged for r in s) >= needed]
        if sets:  # of the smallest sets, the one whose most recently used member is used least recently
            return min(sets, key=lambda s: sorted((r.last_used for r in s), reverse=True))
    return None


def _park_or_stop(chosen: list[Resident], needed: int) -> tuple[Victim, ...]:
    """Each victim parks if the room still suffices with its parked footprint left, else it stops.

    The most recently used victims are offered parking first: they are likelier to be asked for again.
    """
    actions = {r.name: "stop" for r in chosen}
    freed = sum(r.charged for r in chosen)
    for r in sorted(chosen, key=lambda r: r.last_used, reverse=True):
        if r.holding is Holding.AWAKE and r.can_park and freed - r.parked_memory >= needed:
            actions[r.name] = "park"
            freed -= r.parked_memory
    return tuple(
        Victim(r.name, actions[r.name], r.charged - (r.parked_memory if actions[r.name] == "park" else 0))
        for r in chosen
    )


def next_in_line(oldest_waiting: Mapping[str, float]) -> str | None:
    """The model to switch in next: the one whose waiting request arrived first."""
    if not oldest_waiting:
        return None
    return min(oldest_waiting, key=lambda name: (oldest_waiting[name], name))


class Gate(enum.StrEnum):
    ADMIT = "admit"  # the victim still admits its own traffic
    DRAIN = "drain"  # it admits nothing new; requests at its engine finish
    DRAINED = "drained"  # nothing left at its engine: it may park or stop
    TIMED_OUT = "timed_out"  # the drain ran past its bound: the switch fails, the victim keeps serving


class Window(msgspec.Struct, frozen=True, kw_only=True):
    """A victim's admission window and drain, from the moment the switch was planned."""

    planned_at: float
    admission_window: float = 2.0
    drain_timeout: float = 30.0
    closed_at: float | None = None  # when the window closed (at its end, or early when the victim was idle)


def gate(window: Window, now: float, in_flight: int) -> tuple[Gate, Window]:
    """Where the victim stands at ``now`` with ``in_flight`` requests at its engine; the window as it is now.

    The window never resets: new traffic admitted during it does not extend it.
    It closes early the first time the victim is idle.
    """
    if window.closed_at is None:
        if in_flight == 0:
            return Gate.DRAINED, msgspec.structs.replace(window, closed_at=now)
        end = window.planned_at + window.admission_window
        if now < end:
            return Gate.ADMIT, window
        window = msgspec.structs.replace(window, closed_at=end)
    if in_flight == 0:
        return Gate.DRAINED, window
    assert window.closed_at is not None
    if now >= window.closed_at + window.drain_timeout:
        return Gate.TIMED_OUT, window
    return Gate.DRAIN, window


class Idle(msgspec.Struct, frozen=True, kw_only=True):
    park_after: float | None = None  # seconds without requests before an idle model parks
    stop_after: float | None = None  # ... before it stops (an idle stop is not sticky)


def idle_step(idle: Idle, now: float, last_used: float, holding: Holding, busy: bool, can_park: bool) -> str | None:
    """ "park", "stop" or None for a model with no request at its engine or waiting (``busy`` False).

    A stop that is due wins over a park; a parked model stops after ``stop_after``.
    A model that cannot park (restart_only) stops when its park is due.
    """
    if busy or holding is Holding.NONE:
        return None
    quiet = now - last_used
    if idle.stop_after is not None and quiet >= idle.stop_after:
        return "stop"
    if holding is Holding.AWAKE and idle.park_after is not None and quiet >= idle.park_after:
        return "park" if can_park else "stop"
    return None
