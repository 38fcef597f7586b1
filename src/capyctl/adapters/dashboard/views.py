"""What each dashboard page shows, as plain data read from the services the CLI reads.

No HTML here: the templates render these structs, and the live stream sends a
fragment again only when its struct changed. Nothing here decides anything
the domain already decides: the actions allowed follow the deployment's
state and what the fleet accepts, and what a start would do to a device is
the domain's own ``plan`` on the switchboard's own view of each resident.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import msgspec

from capyctl.domain.deployments import Desired, InstanceState
from capyctl.domain.memory import Device, Fits, Holding, NeverFits, NotNow, Residency, Resident, SwitchPlan, gib, plan
from capyctl.domain.request_charts import Recent
from capyctl.services.admission import AdmissionService
from capyctl.services.controllers import Controller, ManagedController
from capyctl.services.instances import InstanceSet
from capyctl.services.switching import NoSwitchboard, Switchboard

S = InstanceState
ACTIONS = ("start", "stop", "park")
_TRANSITIONAL = (S.STARTING, S.STOPPING, S.PARKING, S.WAKING)


class Action(msgspec.Struct, frozen=True):
    name: str  # start | stop | park
    allowed: bool
    why_not: str = ""  # when not allowed: what the operator reads on the disabled button


class Progress(msgspec.Struct, frozen=True):
    """A start or a wake under way: seconds so far against the median of the measured ones."""

    what: str  # "start" | "wake"
    elapsed: float
    usual: float | None  # None until one was measured


class InstanceChip(msgspec.Struct, frozen=True):
    """One instance on a fleet card of a deployment with several."""

    index: int
    host: str | None  # None: the server's own machine
    state: str
    in_flight: int


class Card(msgspec.Struct, frozen=True):
    name: str
    api: str
    engine: str  # family
    engine_version: str
    attached: bool
    host: str | None  # the host whose engine runs it; None: the server's own machine
    state: str
    since: float | None  # wall time the state began, as far as this server saw it
    age: str  # for how long, coarse ("12 s", "3 min", "2 h"): the card changes as seldom as this does
    desired: str
    operator_stopped: bool
    pid: int | None
    restarts: int
    in_flight: int
    waiting: int
    recent: Recent | None  # its answers over the last 5 minutes (None: no request in them)
    last_error: str | None
    progress: Progress | None
    actions: tuple[Action, ...]
    held: str | None = None  # why its engine, still running on its host, cannot be reached now
    note: str | None = None  # how its last engine ended, when that was no error of its own (its host's doing)
    instances: tuple[InstanceChip, ...] = ()  # each instance, when the deployment has several
    unplaced: tuple[str, ...] = ()  # why instances it should run have no place (``domain.placement``)

    def action(self, name: str) -> Action:
        return next(a for a in self.actions if a.name == name)


def actions_for(controller: Controller) -> tuple[Action, ...]:
    """Which of start, stop and park an operator may ask now, and why not where not."""
    state, desired = controller.status.state, controller.desired
    stopped = desired is Desired.STOP
    running = state in (S.READY, S.STARTING, S.WAKING) and not stopped
    start = Action("start", not running or state is S.FAILED, "" if not running else f"it is {state} already")
    stop = Action("stop", not (stopped and state in (S.STOPPED, S.FAILED)), "it is stopped already" if stopped else "")
    if not isinstance(controller, ManagedController):
        park = Action("park", False, "attached: CapyCTL does not run its engine")
    elif stopped:
        park = Action("park", False, "an operator stopped it")
    elif state is not S.READY:
        park = Action("park", False, f"only a ready engine parks; it is {state}")
    else:
        park = Action("park", True)
    return start, stop, park


def _progress(controller: Controller) -> Progress | None:
    loading = controller.loading()
    state = controller.status.state
    if state not in (S.STARTING, S.WAKING) or loading.starting_for is None:
        return None
    measured = loading.cold_starts  # a wake's loading() carries the measured wakes
    usual = round(statistics.median(measured), 1) if measured else None
    return Progress("wake" if state is S.WAKING else "start", round(loading.starting_for, 1), usual)


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and its noun, singular for exactly one: "1 request", "0 requests", "2 waiting requests"."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def _verb(n: int, one: str, many: str) -> str:
    return one if n == 1 else many


def coarse(seconds: float) -> str:
    if seconds < 60:
        return f"{max(0, int(seconds))} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min"
    if seconds < 2 * 86400:
        return f"{int(seconds // 3600)} h"
    return f"{int(seconds // 86400)} days"


def card(
    controller: Controller,
    admission: AdmissionService,
    since: float | None,
    now: float,
    recent: Recent | None = None,
    members: Sequence[Controller] = (),
    unplaced: Sequence[str] = (),
) -> Card:
    status = controller.status
    held = controller.held()
    shown_error = status.last_error if status.state in (S.FAILED, S.UNAVAILABLE) or status.restarts else None
    blameless = controller.ended_by is not None  # an end that was its host's doing is said, not shown as an error
    return Card(
        name=controller.name,
        api=controller.spec.api,
        engine=str(controller.engine.family),
        engine_version=controller.engine.version,
        attached=controller.spec.attached,
        host=controller.deployment.host,
        state="held" if held is not None else str(status.state),
        since=since,
        age="" if since is None else coarse(now - since),
        desired=str(controller.desired),
        operator_stopped=controller.deployment.operator_stopped,
        pid=status.pid,
        restarts=status.restarts,
        in_flight=admission.state.in_flight(controller.name),
        waiting=admission.state.waiting(controller.name),
        recent=recent,
        last_error=None if blameless else shown_error,
        progress=_progress(controller),
        actions=actions_for(controller),
        held=None if held is None else held.message,
        note=status.last_error if blameless else None,
        instances=tuple(
            InstanceChip(m.index, m.host, "held" if m.held() is not None else str(m.status.state), m.in_flight)
            for m in members
        )
        if len(members) > 1
        else (),
        unplaced=tuple(unplaced),
    )


def unplaced_card(found: InstanceSet, admission: AdmissionService) -> Card:
    """The card of a deployment none of whose instances has a place: why, and a start (which places again)."""
    why = "no instance placed: see why below"
    return Card(
        name=found.name,
        api=found.spec.api,
        engine=str(found.engine.family),
        engine_version=found.engine.version,
        attached=False,
        host=None,
        state="unplaced",
        since=None,
        age="",
        desired=str(found.desired),
        operator_stopped=found.deployment.operator_stopped,
        pid=None,
        restarts=0,
        in_flight=admission.state.in_flight(found.name),
        waiting=admission.state.waiting(found.name),
        recent=None,
        last_error=None,
        progress=None,
        actions=(Action("start", True), Action("stop", False, why), Action("park", False, why)),
        unplaced=tuple(found.unplaced),
    )


# --- memory -------------------------------------------------------------------------------------------
class Segment(msgspec.Struct, frozen=True):
    deployment: str
    size: int  # bytes charged now
    kind: str  # "awake" | "parked"
    unsettled: int  # cut requests still counted against the memory (settled by the engine's idle or stop)
    start_pct: float  # where it begins on the bar, in % of capacity
    width_pct: float


class Outlook(msgspec.Struct, frozen=True):
    """For a deployment that holds nothing: what starting it would take, by the domain's ``plan``."""

    deployment: str
    needs: int
    verdict: str  # "fits" | "switch" | "never" | "not_now"
    text: str
    victims: tuple[tuple[str, str, int], ...] = ()  # (name, "park" | "stop", bytes freed)


class Bar(msgspec.Struct, frozen=True):
    device: str
    capacity: int
    reserve: int
    free: int
    segments: tuple[Segment, ...]
    reserve_pct: float
    outlooks: tuple[Outlook, ...]
    last_switch: dict[str, object] | None


def _pct(size: int, capacity: int) -> float:
    return round(100.0 * size / capacity, 2) if capacity > 0 else 0.0


def outlook(room: Switchboard, controller: ManagedController, others: Sequence[ManagedController]) -> Outlook:
    device = room.device_of(controller)
    assert device is not None
    return _outlook(device, room.resident(controller), [room.resident(o) for o in others])


def _outlook(device: Device, target: Resident, others: list[Resident]) -> Outlook:
    outcome = plan(device, target, others)
    if isinstance(outcome, Fits):
        text = f"fits now: {gib(outcome.free)} would be left free"
        return Outlook(target.name, target.memory, "fits", text)
    if isinstance(outcome, SwitchPlan):
        victims = tuple((v.name, v.action, v.frees) for v in outcome.victims)
        moves = ", ".join(f"{action} {name} (frees {gib(frees)})" for name, action, frees in victims)
        return Outlook(target.name, target.memory, "switch", f"a switch would {moves}", victims)
    if isinstance(outcome, NeverFits):
        return Outlook(target.name, target.memory, "never", outcome.reason)
    assert isinstance(outcome, NotNow)
    return Outlook(target.name, target.memory, "not_now", outcome.reason)


Outlooks = dict[str, tuple[dict[str, Resident], tuple[Outlook, ...]]]  # device -> (residents, their outlooks)


def bars(
    room: Switchboard | NoSwitchboard, controllers: Sequence[Controller], memo: Outlooks | None = None
) -> list[Bar]:
    """One bar per device: what each deployment holds (awake or parked), the reserve and what is free; and,
    for each deployment on it that holds nothing, what starting it would take."""
    if not isinstance(room, Switchboard):
        return []
    out = []
    for device in room.every_device():
        # managed ones only: an attached engine is charged against no device
        on = [c for c in controllers if isinstance(c, ManagedController) and room.is_on(c, device)]
        charged = room.charged(device)
        segments, at = [], 0
        for c in on:
            size = charged.get(c.name, 0)
            if not size:
                continue
            holding = c.holding
            unsettled = sum(int(entry["count"]) for entry in c.settlement.ledger.counts())
            kind = "parked" if holding is Holding.PARKED else "awake"
            segments.append(
                Segment(c.name, size, kind, unsettled, _pct(at, device.capacity), _pct(size, device.capacity))
            )
            at += size
        residents = {c.name: room.resident(c) for c in on}  # read once: every outlook weighs all the others
        known = memo.get(device.name) if memo is not None else None
        if known is not None and known[0] == residents:  # same residents as last time: the same plans
            outlooks = known[1]
        else:
            outlooks = tuple(
                _outlook(device, residents[c.name], [r for n, r in residents.items() if n != c.name])
                for c in on
                if c.holding is Holding.NONE
            )
            if memo is not None:
                memo[device.name] = (residents, outlooks)
        out.append(
            Bar(
                device=device.name,
                capacity=device.capacity,
                reserve=device.reserve,
                free=device.usable - sum(charged.values()),
                segments=tuple(segments),
                reserve_pct=_pct(device.reserve, device.capacity),
                outlooks=outlooks,
                last_switch=room.last_switch.get(device.name),
            )
        )
    return out


def frees_on_park(controller: Controller, charged: int) -> int:
    """Bytes a park gives back: all of it for restart_only (a park stops it), else all but the parked part."""
    if controller.spec.residency is Residency.RESTART_ONLY:
        return charged
    return max(0, charged - controller.spec.resources.parked_bytes)


def consequences(
    action: str,
    controller: Controller,
    admission: AdmissionService,
    room: Switchboard | NoSwitchboard,
    controllers: Sequence[Controller],
) -> list[str]:
    """What an action will do, in the words of the confirmation page: requests, memory, what waits."""
    name, status = controller.name, controller.status
    in_flight, waiting = admission.state.in_flight(name), admission.state.waiting(name)
    device = room.device_of(controller)
    charged = room.charged(device).get(name, 0) if device is not None else 0
    out: list[str] = []
    if action == "start":
        if controller.desired is Desired.STOP:
            out.append("It lifts the operator's stop: requests may use the deployment again.")
        if status.state is S.PARKED:
            out.append("It wakes the sleeping engine.")
        elif status.state is S.FAILED:
            out.append("It gives the failed deployment a new start budget and starts its engine.")
        elif not controller.spec.attached:
            out.append("It starts the engine and keeps it running.")
        if (
            isinstance(room, Switchboard)
            and device is not None
            and isinstance(controller, ManagedController)
            and controller.holding is Holding.NONE
        ):
            others = [
                c
                for c in controllers
                if c is not controller and isinstance(c, ManagedController) and room.is_on(c, device)
            ]
            out.append(f"Memory on {device.name}: {outlook(room, controller, others).text}.")
        if waiting:
            out.append(f"{counted(waiting, 'waiting request')} {_verb(waiting, 'is', 'are')} served once it is ready.")
    elif action == "stop":
        out.append(
            "It stops the engine (SIGTERM, then SIGKILL after the grace period). The stop is sticky: "
            "requests do not start it again until an operator starts it."
        )
        out.append(
            f"{counted(in_flight, 'request')} in flight {_verb(in_flight, 'is', 'are')} cut; "
            f"{counted(waiting, 'waiting request')} {_verb(waiting, 'is', 'are')} refused (deployment_stopped)."
        )
        if device is not None:
            out.append(f"It frees {gib(charged)} on {device.name}.")
    else:
        out.append(
            f"It lets the {counted(in_flight, 'request')} in flight finish (bounded by switching.drain_timeout), "
            "then parks the engine; the next request wakes it."
        )
        if controller.spec.residency is Residency.RESTART_ONLY:
            out.append("Its residency is restart_only: parking stops the engine (not stickily).")
        if waiting:
            out.append(
                f"{counted(waiting, 'waiting request')} {_verb(waiting, 'keeps', 'keep')} waiting, and "
                f"{_verb(waiting, 'wakes', 'wake')} it again."
            )
        if device is not None:
            out.append(f"It frees {gib(frees_on_park(controller, charged))} on {device.name}.")
    return out
