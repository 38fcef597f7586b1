"""Admission: who is sent to an engine now, who waits, who is refused (LIFE-4, LIFE-5).

Pure state and rules, no I/O and no clock reads (times are passed in). One
``Admission`` holds, per deployment, the requests at the engine (``in_flight``)
and the requests waiting in arrival order (``queue``); the service that owns
it applies its decisions (wakes waiters, answers refusals).

Rules:
- a request is granted at once when its deployment is ready, has a free slot
  (``max_in_flight_per_instance``) and nobody waits before it;
- otherwise it waits at the end of its deployment's queue, unless that queue
  holds ``max_pending_per_deployment`` or all queues ``max_pending_total``
  (``queue_full``); 0 means never wait;
- ``max_open`` (when not 0) caps granted requests over all deployments; past
  it a request is refused at once (``device_busy``);
- a freed slot, or a deployment becoming ready, grants waiters in arrival
  order (``grants``); a waiter that leaves frees only its own place.
Counting starts at the grant: a waiter is never counted in flight.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import NamedTuple

import msgspec

from capyctl.domain.lifecycle import EngineAddress


class Route(NamedTuple):
    """Where a request was sent: the engine's address, and which launch of the engine answered there."""

    address: EngineAddress
    launch: int


class Loading(NamedTuple):
    """A model that is not ready, as a client is told about it: its state, and what its starts measured."""

    state: str
    starting_for: float | None  # seconds since the current start began, None when none is under way
    cold_starts: list[float]


class QueueLimits(msgspec.Struct, frozen=True, kw_only=True):
    max_in_flight_per_instance: int = 32
    max_pending_per_deployment: int = 64
    max_pending_total: int = 256
    max_open: int = 0  # open engine calls over all deployments; 0 = no limit


class Refused(msgspec.Struct, frozen=True):
    code: str  # queue_full | device_busy


GRANTED = "granted"
QUEUED = "queued"


class _Deployment:
    __slots__ = ("in_flight", "queue", "service_times", "capacity")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # requests its engines take at once: the per-instance limit, per instance
        self.in_flight = 0
        self.queue: deque[str] = deque()
        self.service_times: deque[float] = deque(maxlen=64)  # seconds a granted request held its slot


class Admission:
    def __init__(self, limits: QueueLimits) -> None:
        self.limits = limits
        self._deployments: dict[str, _Deployment] = {}
        self.open = 0  # granted requests over all deployments
        self.pending = 0  # waiting requests over all deployments

    def _of(self, name: str) -> _Deployment:
        state = self._deployments.get(name)
        if state is None:
            state = self._deployments[name] = _Deployment(self.limits.max_in_flight_per_instance)
        return state

    def scale(self, name: str, instances: int) -> None:
        """``name`` has ``instances`` instances: it takes the per-instance limit as many times at once (one
        waiting line, whichever instance frees a place first)."""
        state = self._of(name)
        state.capacity = self.limits.max_in_flight_per_instance * instances

    def grants_at_once(self, name: str) -> bool:
        """Whether a request for ``name`` (ready) arriving now would be granted without waiting: a free place
        at its engines, nobody in line before it, and room under ``max_open``. Changes nothing."""
        state = self._deployments.get(name)
        if state is not None and (state.in_flight >= state.capacity or state.queue):
            return False
        capacity = state.capacity if state is not None else self.limits.max_in_flight_per_instance
        return not (self.limits.max_open and self.open >= self.limits.max_open) and capacity > 0

    def arrive(self, name: str, request: str, ready: bool) -> str | Refused:
        """GRANTED, QUEUED (at the end of the queue) or a refusal, for a request that just came in."""
        state = self._of(name)
        if ready and state.in_flight < state.capacity and not state.queue:
            if self.limits.max_open and self.open >= self.limits.max_open:
                return Refused("device_busy")
            state.in_flight += 1
            self.open += 1
            return GRANTED
        if len(state.queue) >= self.limits.max_pending_per_deployment or self.pending >= self.limits.max_pending_total:
            return Refused("queue_full")
        state.queue.append(request)
        self.pending += 1
        return QUEUED

    def position(self, name: str, request: str) -> int | None:
        """1 for the next request to be granted; None when it is not waiting."""
        try:
            return self._of(name).queue.index(request) + 1
        except ValueError:
            return None

    def leave(self, name: str, request: str) -> bool:
        """A waiter gives up (client gone, deadline, its wait bound): only its place is freed."""
        state = self._of(name)
        try:
            state.queue.remove(request)
        except ValueError:
            return False
        self.pending -= 1
        return True

    def grants(self, name: str, ready: bool) -> list[str]:
        """The waiters to grant now, in arrival order (counted in flight from here)."""
        state = self._of(name)
        granted: list[str] = []
        while ready and state.queue and state.in_flight < state.capacity:
            if self.limits.max_open and self.open >= self.limits.max_open:
                break
            granted.append(state.queue.popleft())
            self.pending -= 1
            state.in_flight += 1
            self.open += 1
        return granted

    def release(self, name: str, held_for: float | None) -> None:
        """A granted request left the engine; ``held_for`` is how long it held its slot (None: not measured)."""
        state = self._of(name)
        state.in_flight -= 1
        self.open -= 1
        if held_for is not None:
            state.service_times.append(held_for)

    def in_flight(self, name: str) -> int:
        return self._of(name).in_flight

    def queued(self, name: str) -> list[str]:
        """The requests waiting for ``name``, first to be granted first."""
        return list(self._of(name).queue)

    def waiting(self, name: str) -> int:
        return len(self._of(name).queue)

    def retry_after(self, name: str, position: int | None = None) -> int:
        """Seconds until a place is likely free, from this deployment's measured service times.

        ``position`` places ahead of this one (default: the whole queue) drain at ``capacity`` at a
        time, each taking the median measured time; 1 s when nothing was measured yet.
        """
        state = self._of(name)
        if not state.service_times:
            return 1
        ahead = len(state.queue) if position is None else position
        rounds = max(1, math.ceil(max(ahead, 1) / state.capacity))
        return max(1, math.ceil(rounds * statistics.median(state.service_times)))


def loading_retry_after(cold_starts: list[float], starting_for: float | None) -> int:
    """Seconds until a starting model is likely ready: its median measured start less the time spent so far.

    With no start measured yet, the time the current start has already taken (it will take at
    least that long again as a rough bound), at least 1 s.
    """
    if cold_starts:
        left = statistics.median(cold_starts) - (starting_for or 0.0)
        return max(1, math.ceil(left))
    return max(1, math.ceil(starting_for or 1.0))
