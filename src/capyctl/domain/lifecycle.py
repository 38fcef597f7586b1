"""A managed deployment's decisions while its engine runs, and what a waiting request is told.

``deployments.next_step`` decides what the controller does while no engine
runs. The functions here decide the rest, from what the controller knows and
nothing else (no clock, no I/O), so each rule is a table test:

- ``watch_step``: with an engine running, park it, wake it, or keep watching;
- ``on_desire``: what a new desired state does at once (show STARTING, or
  end the launch under way);
- ``stop_path``: the states an instance passes through to show that no
  engine runs any more;
- ``route_step``: what a request waiting for the engine is told;
- ``give_way``: how a switch moves a deployment out of its device's way;
- ``holding``, ``failures_after``, ``ending_state``, ``wake_matches``:
  what it holds on its device, how a launch counts, how it ends, whether a
  woken engine answers as before.

``Launched`` is what the controller knows of one launch of its engine,
wherever that engine runs.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

import msgspec

from capyctl.domain.deployments import Desired, InstanceState
from capyctl.domain.memory import Holding, Residency

S = InstanceState
RUNNING = (S.STARTING, S.READY, S.PARKING, S.PARKED, S.WAKING)  # states in which an engine may still run


class EngineAddress(msgspec.Struct, frozen=True, gc=False):
    """Where an engine answers requests: its base URL (``http://`` on this machine, ``https://`` to a host's
    ingress), and for a host's ingress the name its certificate must hold and the launch's gate key, sent
    in a header of its own (never inside the URL)."""

    url: str
    tls_name: str | None = None
    gate: str | None = None


class Launched(msgspec.Struct, frozen=True, kw_only=True):
    """One launch of a deployment's engine, as its effects report it (``EngineEffects.launch``)."""

    number: int  # the deployment's launches count from 1; a route names the launch it was given
    address: EngineAddress  # where the engine answers requests
    pid: int | None = None  # its process, where the effects can tell
    port: int | None = None  # where the engine listens, on its own machine's loopback
    ingress_port: int | None = None  # on a host: its ingress's port, which the server reaches the engine through
    log_path: str | None = None  # where its output goes
    adopted: bool = False  # already running (on a host, launched by a server before this one): taken over


class Watch(enum.StrEnum):
    PARK = "park"  # the engine serves and should sleep (the switchboard drained it first)
    WAKE = "wake"  # it sleeps and a request or an operator wants it
    WAIT = "wait"  # nothing to do until a command, or until the engine exits


def watch_step(desired: Desired, state: InstanceState) -> Watch:
    """The decision while an engine process runs (``next_step`` is the one while none does)."""
    if desired is Desired.PARK and state is S.READY:
        return Watch.PARK
    if desired is Desired.RUN and state is S.PARKED:
        return Watch.WAKE
    return Watch.WAIT


class OnDesire(enum.StrEnum):
    START = "start"  # show STARTING at once, so the very next look at it says it is starting
    CANCEL = "cancel"  # no engine should run: end the launch under way (its cleanup ends the engine)
    NOTHING = "nothing"


def on_desire(desired: Desired, state: InstanceState, launching: bool) -> OnDesire:
    if desired is Desired.RUN and state in (S.STOPPED, S.FAILED):
        return OnDesire.START
    if desired in (Desired.ON_DEMAND, Desired.STOP) and launching:
        return OnDesire.CANCEL
    return OnDesire.NOTHING


def fresh_budget(desired: Desired, state: InstanceState) -> bool:
    """An operator's start of a stopped or FAILED deployment gets a new start budget, with no backoff."""
    return desired is Desired.RUN and state in (S.STOPPED, S.FAILED)


def stop_path(state: InstanceState, desired: Desired) -> tuple[InstanceState, ...]:
    """The states that show no engine runs any more: through STOPPING to STOPPED. A FAILED deployment
    stays FAILED while it is still wanted, so requests keep being told why."""
    path: list[InstanceState] = []
    if state in RUNNING:
        path.append(state := S.STOPPING)
    if state is S.STOPPING or (state is S.FAILED and desired is not Desired.RUN):
        path.append(S.STOPPED)
    return tuple(path)


def ending_state(state: InstanceState, cancelled: bool) -> InstanceState | None:
    """The state shown while a launch ends an engine that still runs: STOPPING for a stop (a cancellation);
    STARTING for a launch that broke or failed, as a failed start, so no request is routed to it."""
    if cancelled:
        return S.STOPPING
    return None if state is S.STARTING else S.STARTING


def failures_after(failures: int, ready_for: float | None, stable_after: float, ended_by: str | None = None) -> int:
    """Failed starts in a row after a launch ended: one more unless it was ready for ``stable_after`` seconds
    (``ready_for`` None: it never was), so an engine that crashes after each start backs off and ends FAILED.
    An engine ended by something else than itself (``ended_by``: its host's agent stopped, its host came back
    without it) is no failure of its own: the count stays as it was."""
    if ended_by is not None:
        return failures
    if ready_for is not None and ready_for >= stable_after:
        return 0
    return failures + 1


class RouteStep(enum.StrEnum):
    SERVE = "serve"  # the engine is ready: route to it
    STOPPED = "stopped"  # an operator's stop holds: DeploymentStopped
    REFUSED = "refused"  # no room on its device for the start this request asked for
    ASK_AGAIN = "ask_again"  # it gave way to a switch meanwhile: ask for it again
    FAILED = "failed"  # its start budget is spent: LlmUnavailable with the last error
    CLOSED = "closed"  # CapyCTL shuts down, or the deployment is deleted
    WAIT = "wait"  # until something changes


def route_step(desired: Desired, state: InstanceState, refused: bool, closed: bool) -> RouteStep:
    """What a request waiting for the engine is told now; ``refused``: its own ask was refused for want of room."""
    if desired is Desired.STOP:
        return RouteStep.STOPPED
    if refused:
        return RouteStep.REFUSED
    if state is S.READY:
        return RouteStep.SERVE
    if state in (S.STOPPED, S.PARKED) and desired in (Desired.ON_DEMAND, Desired.PARK):
        return RouteStep.ASK_AGAIN
    if state is S.FAILED:
        return RouteStep.FAILED
    return RouteStep.CLOSED if closed else RouteStep.WAIT


def gone(launch: int, current: int, state: InstanceState) -> bool:
    """True once the engine of ``launch`` no longer serves (crashed, stopping, parked, replaced)."""
    return launch != current or state is not S.READY


class GiveWay(NamedTuple):
    parks: bool  # True: wait until it sleeps; False: until its process is gone
    desired: Desired | None  # the desired state to set, None to leave it


def give_way(park: bool, residency: Residency, holds: bool, desired: Desired) -> GiveWay:
    """How a deployment makes way on its device, not stickily (the next request wakes or starts it): it parks
    when asked to and its residency can, while it holds room; otherwise it stops. An operator's stop stays."""
    if park and residency is not Residency.RESTART_ONLY and holds:
        return GiveWay(True, None if desired is Desired.STOP else Desired.PARK)
    return GiveWay(False, Desired.ON_DEMAND if desired in (Desired.RUN, Desired.PARK) else None)


def holding(holds: bool, wake_granted: bool, state: InstanceState) -> Holding:
    """What it holds on its device, by the evidence: awake from the grant of room until its process is gone,
    except while the engine has confirmed it sleeps (and no wake has been granted room since)."""
    if not holds:
        return Holding.NONE
    if state is S.PARKED and not wake_granted:
        return Holding.PARKED
    return Holding.AWAKE


def wake_matches(reference: str | None, answer: str | None) -> bool:
    """A woken engine answers the canary as it did at its launch's first readiness (nothing to compare: yes)."""
    return reference is None or answer == reference


def keep_last(times: list[float], seconds: float, count: int = 20) -> list[float]:
    return [*times[-(count - 1) :], seconds]
