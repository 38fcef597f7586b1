"""Balancing and failover: which instance of a deployment takes a request, and when a request may move on.

``choose`` scores each instance by its load and takes the least:

- an instance's load is the larger of the requests CapyCTL has in flight
  there and the engine's own running + waiting counts from a sample at most
  ``SAMPLE_MAX_AGE`` seconds old (the engine may serve other clients, or
  hold requests CapyCTL has cut that it still runs), less those of CapyCTL's
  requests the sample counted that have ended since (a sample taken while
  one request ran must not make its instance look busy once it is answered;
  at most the requests CapyCTL had there when the sample was taken are taken
  off, so the engine's other clients always count);
- a sample that is missing, failed or stale is unknown load, never zero:
  such an instance counts as loaded as the busiest instance whose load is
  known (at least its own in-flight count), so it neither draws every
  request nor is starved;
- KV-cache pressure adds up to ``KV_PENALTY`` requests from
  ``KV_PRESSURE_FROM`` of the cache in use to all of it, where the engine
  reports it;
- an instance that is not ready (parked, stopped on demand, waking) counts
  its wake cost: ``wake_cost`` requests more (the server sets it to one
  instance's in-flight limit, so a sleeping instance is woken only once the
  ready ones are that loaded);
- equal scores take turns (``turn`` counts the deployment's choices).

``may_fail_over`` is the one rule for moving a request to another instance:
only when nothing can have reached an engine (``UNSENT_CAUSES``), at most
``MAX_TRIES`` instances per request.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NamedTuple

SAMPLE_MAX_AGE = 3.0  # seconds a load sample stands for the engine's load
KV_PRESSURE_FROM = 0.8  # share of the KV cache in use from which the penalty grows
KV_PENALTY = 4  # requests the penalty adds with the whole cache in use
MAX_TRIES = 4  # instances one request may be sent to (the first included)


class Sample(NamedTuple):
    """What an engine said of its load, and when (monotonic seconds)."""

    running: int
    waiting: int
    at: float
    kv_usage: float | None = None  # share of the KV cache in use, 0..1, where the engine reports it
    in_flight: int = 0  # CapyCTL's requests at the instance when the sample was taken
    left: int = 0  # how many of CapyCTL's requests had left the instance by then (a running count)


class Load(NamedTuple):
    """One instance as ``choose`` sees it."""

    instance: int  # its index
    ready: bool
    in_flight: int  # CapyCTL's requests there now
    sample: Sample | None  # the engine's latest load sample; None: none taken, or the last read failed
    left: int = 0  # how many of CapyCTL's requests have left the instance so far (a running count)


class Score(NamedTuple):
    """An instance's score and what made it (the ``router_selection`` event's inputs)."""

    instance: int
    score: float
    in_flight: int
    engine: int | None  # running + waiting from a fresh sample; None: unknown
    age_s: float | None  # the sample's age


class Choice(NamedTuple):
    instance: int
    scores: list[Score]


def _known(load: Load, now: float) -> int | None:
    """The engine's running + waiting from a fresh sample, less CapyCTL's requests it counted that have
    ended since; None when no fresh sample stands."""
    sample = load.sample
    if sample is None or now - sample.at > SAMPLE_MAX_AGE or now < sample.at:
        return None
    ended = min(max(0, load.left - sample.left), sample.in_flight)
    return max(0, sample.running + sample.waiting - ended)


def _pressure(sample: Sample | None) -> float:
    if sample is None or sample.kv_usage is None:
        return 0.0
    return KV_PENALTY * max(0.0, min(1.0, sample.kv_usage) - KV_PRESSURE_FROM) / (1.0 - KV_PRESSURE_FROM)


def scores(loads: Sequence[Load], now: float, wake_cost: int) -> list[Score]:
    """Each instance's score (see the module)."""
    engine = {load.instance: _known(load, now) for load in loads}
    known = [max(load.in_flight, e) for load in loads if (e := engine[load.instance]) is not None]
    busiest = max(known, default=0)
    out = []
    for load in loads:
        seen = engine[load.instance]
        base = max(load.in_flight, seen) if seen is not None else max(load.in_flight, busiest)
        fresh = seen is not None
        score = base + (_pressure(load.sample) if fresh else 0.0) + (0 if load.ready else wake_cost)
        age = None if load.sample is None else round(now - load.sample.at, 3)
        out.append(Score(load.instance, score, load.in_flight, seen, age))
    return out


def choose(loads: Sequence[Load], now: float, wake_cost: int, turn: int) -> Choice:
    """The instance with the least score; equal ones take turns by ``turn``. ``loads`` is not empty."""
    scored = scores(loads, now, wake_cost)
    least = min(s.score for s in scored)
    tied = [s.instance for s in scored if s.score == least]
    return Choice(tied[turn % len(tied)], scored)


class Unsent(enum.StrEnum):
    """Why a request reached no engine: the causes under which it may go to another instance."""

    REFUSED = "connection_refused"  # nothing listened: the connection was refused, reset or timed out
    TLS = "tls_failed"  # the handshake with a host's ingress failed, or it showed another certificate
    NOT_FORWARDED = "not_forwarded"  # a host's ingress answered itself, saying it forwarded nothing
    GATE_CLOSED = "gate_closed"  # the host's agent no longer knows the launch's gate key
    HOST_AWAY = "host_away"  # the instance's host was suspended, lost or revoked when the request was routed


UNSENT_CAUSES = frozenset(Unsent)


def may_fail_over(cause: str | None, tries: int) -> bool:
    """Whether a request that ``tries`` instances failed, the last for ``cause``, goes to another one: only
    when nothing reached an engine (``cause`` is one of ``Unsent``) and fewer than ``MAX_TRIES`` were tried."""
    return cause in UNSENT_CAUSES and tries < MAX_TRIES
