"""The switchboard: room on a device for an engine, made by switching models out when needed (LIFE-3, LIFE-5).

A managed controller asks ``claim`` before each launch. With no device
declared, or no ``resources.memory`` on the deployment, the claim is granted
at once: nothing is accounted. Otherwise the domain's ``plan`` decides:

- it fits: granted; the controller holds its footprint from now until its
  process is gone;
- it never can: ``InsufficientMemory`` at once, with the figures;
- victims must make room: a switch. Each victim keeps admitting its own
  traffic for the admission window, then drains (``domain.memory.gate``)
  and gives way (restart_only: it stops, not stickily; its own waiters
  then ask for it again, and it queues for the device like any model). A
  drain that runs out fails the switch: the victims keep serving and the
  claim fails with ``GpuBusy``;
- what holds the room cannot move now (requests wait for it, or it is
  changing state): the claim waits and the plan is made again.

Switches on one device run one at a time; among the claims waiting for a
device, the model whose waiting request arrived first goes next. Nothing
admitted is ever cut by a switch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import anyio

from capyctl.domain.config import Switching
from capyctl.domain.deployments import DeploymentSpec
from capyctl.domain.errors import GpuBusy, InsufficientMemory, StillServing
from capyctl.domain.memory import (
    Device,
    Fits,
    Gate,
    Holding,
    Idle,
    NeverFits,
    NotNow,
    Resident,
    SwitchPlan,
    Window,
    gate,
    idle_step,
    next_in_line,
    plan,
)
from capyctl.domain.ports import Clock
from capyctl.domain.units import seconds
from capyctl.services.admission import AdmissionService
from capyctl.services.events import Events

log = logging.getLogger("capyctl.switching")
LOOK_AGAIN = 0.05  # seconds between looks while a claim waits or a victim drains
IDLE_CHECK = 1.0  # seconds between looks at the idle timers


class Placed(Protocol):
    """What says which device an instance is charged against: its spec, its host and its device there (any
    controller)."""

    @property
    def spec(self) -> DeploymentSpec: ...
    @property
    def host(self) -> str | None:
        """The host its engine runs on; None: the server's own machine."""

    @property
    def device(self) -> str | None:
        """The device it was placed on, by its name on its machine; None: the machine's only one."""


class Occupant(Placed, Protocol):
    """The controller of an engine CapyCTL runs (a managed one), as the switchboard sees it."""

    @property
    def name(self) -> str:
        """Its deployment's name (what admission counts and holds)."""

    @property
    def holder(self) -> str:
        """The instance's own name, what the device's charges are kept under (``instance_id``)."""

    @property
    def holding(self) -> Holding: ...
    @property
    def movable(self) -> bool: ...
    @property
    def ready(self) -> bool: ...

    def unsettled_before_output(self) -> int: ...
    def grant_room(self) -> None: ...
    async def give_way(self, park: bool = False, why: str = "") -> None:
        """Park (when it can) or stop, not stickily; returns once the engine sleeps or its process is gone.
        ``why``: what asked (an operator's park, an idle timer, a switch), for the event a stop leaves."""


class Switchboard:
    def __init__(
        self,
        devices: Sequence[Device],
        switching: Switching,
        admission: AdmissionService,
        clock: Clock,
        events: Events,
        idle: Idle | None = None,
    ) -> None:
        self.devices = {d.name: d for d in devices}
        self._idle = idle or Idle()
        self._switching = switching
        self._admission = admission
        self._clock = clock
        self._events = events
        self._occupants: Callable[[], Sequence[Occupant]] = lambda: ()
        self._host_devices: Callable[[str], Sequence[Device]] = lambda host: ()
        self._busy: set[str] = set()  # devices with a switch (or a plan) under way
        self._claims: dict[str, dict[str, float]] = {}  # device -> name -> since
        self.last_switch: dict[str, dict[str, object]] = {}  # device -> what its last switch did

    def bind(self, occupants: Callable[[], Sequence[Occupant]]) -> None:
        """Where the switchboard finds every deployment's controller (the fleet's)."""
        self._occupants = occupants

    def bind_hosts(self, devices: Callable[[str], Sequence[Device]]) -> None:
        """Where it finds each host's devices, as the host reported them (several machines). A host's device
        is charged under ``<host>/<device>``, apart from the server's devices and other hosts' alike."""
        self._host_devices = devices

    def host_devices(self, host: str) -> dict[str, Device]:
        """Host ``host``'s devices by their name on the host, each named ``<host>/<name>`` here."""
        return {
            d.name: Device(name=f"{host}/{d.name}", capacity=d.capacity, reserve=d.reserve)
            for d in self._host_devices(host)
        }

    def every_device(self) -> list[Device]:
        """The server's devices, then the devices of each host a deployment runs on."""
        hosts = sorted({o.host for o in self._occupants() if o.host is not None})
        return [*self.devices.values(), *(d for host in hosts for d in self.host_devices(host).values())]

    # --- an operator's park, and the idle timers --------------------------------------------------
    async def park(self, occupant: Occupant) -> None:
        """Drain ``occupant`` (bounded by the drain timeout), then park it (restart_only: stop it, not
        stickily). Its waiters wait meanwhile; a drain that runs out leaves it serving."""
        self._admission.hold(occupant.name)
        try:
            began = self._clock.monotonic()
            while self._admission.state.in_flight(occupant.name):
                if self._clock.monotonic() - began >= self._switching.drain_timeout:
                    raise StillServing(
                        occupant.name, self._admission.state.in_flight(occupant.name), self._switching.drain_timeout
                    )
                await anyio.sleep(LOOK_AGAIN)
            await occupant.give_way(park=True, why="operator_park")
        finally:
            self._admission.unhold(occupant.name, occupant)

    async def run(self, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Apply the idle timers (``idle.park_after``, ``idle.stop_after``) until cancelled."""
        task_status.started()
        while True:
            await anyio.sleep(IDLE_CHECK)
            for occupant in list(self._occupants()):
                try:
                    step = self._idle_step(occupant)
                    if step is not None:
                        await self._idle_away(occupant, step)
                except Exception:  # one model's fault must not end the timers, or the fleet
                    log.exception("the idle timer of %s met an unexpected error", occupant.name)

    def _idle_step(self, occupant: Occupant) -> str | None:
        spec, name = occupant.spec, occupant.name
        idle = Idle(
            park_after=self._idle.park_after if spec.idle.park_after is None else seconds(spec.idle.park_after, "idle"),
            stop_after=self._idle.stop_after if spec.idle.stop_after is None else seconds(spec.idle.stop_after, "idle"),
        )
        if idle.park_after is None and idle.stop_after is None or not occupant.movable:
            return None
        state = self._admission.state
        busy = bool(state.in_flight(name) or state.waiting(name))
        resident = self.resident(occupant)
        return idle_step(
            idle,
            self._clock.monotonic(),
            self._admission.last_used.get(name, 0.0),
            resident.holding,
            busy,
            resident.can_park,
        )

    async def _idle_away(self, occupant: Occupant, step: str) -> None:
        self._admission.hold(occupant.name)  # nothing new slips in while it goes
        try:
            if self._admission.state.in_flight(occupant.name):
                return  # a request came in since the look: it is not idle after all
            quiet = round(self._clock.monotonic() - self._admission.last_used.get(occupant.name, 0.0), 1)
            if step == "park":
                self._events.emit(occupant.name, "idle_park", after_s=quiet)
            else:
                self._events.emit(occupant.name, "idle_stop", after_s=quiet)
            await occupant.give_way(park=step == "park", why=f"idle_{step}")
        finally:
            self._admission.unhold(occupant.name, occupant)

    def device_of(self, occupant: Placed) -> Device | None:
        """The device a deployment is charged against (on its host's, when it runs on one); None when it is
        not accounted."""
        return self.device_for(occupant.spec, occupant.host, occupant.device)

    def device_for(self, spec: DeploymentSpec, host: str | None, device: str | None) -> Device | None:
        """The device named ``device`` (None: the only one) on ``host`` (None: the server), where ``spec`` is
        charged; None when it is not accounted."""
        devices = self.devices if host is None else self.host_devices(host)
        if spec.resources.memory_bytes is None or not devices:
            return None
        if device is not None:
            return devices.get(device)
        return next(iter(devices.values())) if len(devices) == 1 else None

    def is_on(self, occupant: Placed, device: Device) -> bool:
        on = self.device_of(occupant)
        return on is not None and on.name == device.name

    def free(self, device: Device) -> int:
        """The bytes of ``device`` no engine holds now."""
        return device.usable - sum(self.charged(device).values())

    def resident(self, occupant: Occupant) -> Resident:
        spec, name = occupant.spec, occupant.name
        return Resident(
            name=occupant.holder,
            memory=spec.resources.memory_bytes or 0,
            parked_memory=spec.resources.parked_bytes,
            residency=spec.residency,
            holding=occupant.holding,
            movable=occupant.movable,
            waiting=self._admission.state.waiting(name),
            # a model with requests at its engine is in use now
            last_used=self._clock.monotonic()
            if self._admission.state.in_flight(name)
            else self._admission.last_used.get(name, 0.0),
            unsettled_before_output=occupant.unsettled_before_output(),
        )

    def charged(self, device: Device) -> dict[str, int]:
        """What each deployment on ``device`` holds now, in bytes."""
        return {o.holder: self.resident(o).charged for o in self._on(device) if o.holding is not Holding.NONE}

    def _on(self, device: Device) -> list[Occupant]:
        return [o for o in self._occupants() if self.is_on(o, device)]

    async def claim(self, occupant: Occupant) -> None:
        """Room for ``occupant``'s engine; it holds its footprint once this returns (``grant_room``)."""
        device = self.device_of(occupant)
        if device is None:
            occupant.grant_room()
            return
        claims = self._claims.setdefault(device.name, {})
        claims[occupant.holder] = self._clock.monotonic()
        try:
            while True:
                if device.name not in self._busy and self._next(device) == occupant.holder:
                    self._busy.add(device.name)
                    try:
                        if await self._try(device, occupant):
                            return
                    finally:
                        self._busy.discard(device.name)
                await anyio.sleep(LOOK_AGAIN)
        finally:
            del claims[occupant.holder]

    def _next(self, device: Device) -> str | None:
        claims = self._claims[device.name]
        waiting = self._admission.oldest_waiting
        since = {holder: waiting(holder.partition("/")[0]) or at for holder, at in claims.items()}
        return next_in_line(since)

    async def _try(self, device: Device, occupant: Occupant) -> bool:
        """One plan for ``occupant``: True once it was granted room, False to look again later."""
        others = [self.resident(o) for o in self._on(device) if o.holder != occupant.holder]
        outcome = plan(device, self.resident(occupant), others)
        if isinstance(outcome, Fits):
            occupant.grant_room()
            return True
        if isinstance(outcome, NeverFits):
            self._events.emit(occupant.name, "switch_failed", device=device.name, reason=outcome.reason)
            raise InsufficientMemory(occupant.name, outcome.reason, self._retry_after(occupant.name))
        if isinstance(outcome, NotNow):
            return False
        assert isinstance(outcome, SwitchPlan)
        await self._switch(device, outcome)
        return False  # planned again at once: it should fit now

    async def _switch(self, device: Device, switch: SwitchPlan) -> None:
        began = self._clock.monotonic()
        described = switch.describe()
        self._events.emit(switch.target, "switch_planned", device=device.name, **described)
        by_name = {o.holder: o for o in self._occupants()}
        victims = [by_name[v.name] for v in switch.victims if v.name in by_name]
        outcomes: dict[str, Gate] = {}
        async with anyio.create_task_group() as tg:
            for victim in victims:
                tg.start_soon(self._drain, victim, began, outcomes)
        if any(outcome is Gate.TIMED_OUT for outcome in outcomes.values()):
            for victim in victims:  # they keep serving: nothing of theirs was cut
                self._admission.unhold(victim.name, victim)
            slow = [holder for holder, outcome in outcomes.items() if outcome is Gate.TIMED_OUT]
            reason = (
                f"{', '.join(slow)} did not finish its requests within switching.drain_timeout "
                f"({self._switching.drain_timeout:.0f} s); it keeps serving"
            )
            self.last_switch[device.name] = {**described, "outcome": "failed", "reason": reason}
            self._events.emit(switch.target, "switch_failed", device=device.name, reason=reason, **described)
            raise GpuBusy(switch.target, reason, self._retry_after(slow[0]))
        actions = {v.name: v.action for v in switch.victims}  # (by holder)
        before = sum(self.charged(device).values())
        async with anyio.create_task_group() as tg:
            for victim in victims:
                tg.start_soon(self._give_way, victim, actions[victim.holder] == "park", f"a switch for {switch.target}")
        seconds = round(self._clock.monotonic() - began, 3)
        if sum(self.charged(device).values()) >= before:  # never plan the same switch again and again
            reason = "the victims gave back no memory (" + ", ".join(v.name for v in victims) + ")"
            self.last_switch[device.name] = {**described, "outcome": "failed", "reason": reason}
            self._events.emit(switch.target, "switch_failed", device=device.name, reason=reason, **described)
            raise GpuBusy(switch.target, reason, self._retry_after(switch.target))
        self.last_switch[device.name] = {**described, "outcome": "completed", "seconds": seconds}
        self._events.emit(switch.target, "switch_completed", device=device.name, seconds=seconds, **described)

    async def _drain(self, victim: Occupant, began: float, outcomes: dict[str, Gate]) -> None:
        window = Window(
            planned_at=began,
            admission_window=self._switching.admission_window,
            drain_timeout=self._switching.drain_timeout,
        )
        while True:
            phase, window = gate(window, self._clock.monotonic(), self._admission.state.in_flight(victim.name))
            if phase is not Gate.ADMIT:
                self._admission.hold(victim.name)
            if phase in (Gate.DRAINED, Gate.TIMED_OUT):
                outcomes[victim.holder] = phase
                return
            await anyio.sleep(LOOK_AGAIN)

    async def _give_way(self, victim: Occupant, park: bool, why: str) -> None:
        try:
            await victim.give_way(park, why)
        finally:
            self._admission.unhold(victim.name, victim)  # its waiters ask for it again

    def _retry_after(self, holder: str) -> int:
        """Seconds until the deployment of ``holder`` (an instance's name, ``instance_id``) likely frees a place."""
        return self._admission.state.retry_after(holder.partition("/")[0], 1)


class NoSwitchboard:
    """Room is always there: no device is accounted, no timer runs (unit tests of the controllers)."""

    devices: dict[str, Device] = {}
    last_switch: dict[str, dict[str, object]] = {}

    async def claim(self, occupant: Occupant) -> None:
        occupant.grant_room()

    async def park(self, occupant: Occupant) -> None:
        await occupant.give_way(park=True, why="operator_park")

    async def run(self, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()

    def charged(self, device: Device) -> dict[str, int]:
        return {}

    def device_of(self, occupant: Placed) -> Device | None:
        return None

    def every_device(self) -> list[Device]:
        return []

    def host_devices(self, host: str) -> dict[str, Device]:
        return {}

    def device_for(self, spec: DeploymentSpec, host: str | None, device: str | None) -> Device | None:
        return None

    def free(self, device: Device) -> int:
        return device.usable
