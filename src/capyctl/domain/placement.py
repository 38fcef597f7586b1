"""Placement: the machine and device each new instance of a deployment runs on, or why none can take it.

A pure rule over what the server knows now. Each machine that has the
deployment's engine offers its devices (``Slot``: a device by its name there,
or one slot with no device when the machine declares none or the deployment
declares no memory). A slot is refused, with the reason said, when:

- its machine is not one ``placement.hosts`` (or ``host``) allows, or not a
  device ``placement.devices`` (or ``resources.device``) allows;
- its host is revoked, or drained by an operator, or not online (only an online host or the server's
  own machine takes a new instance; a host the file names with ``host``
  takes it in any state but revoked, and its instance waits for it);
- its machine already runs ``placement.max_per_host`` instances of it;
- the deployment's memory exceeds what the device can ever hold beside the
  instances of it placed there (the switchboard may make room by switching
  other models out, so what other models hold now only orders the choice).
  When no device of any machine can ever hold even one, the first instance
  is placed all the same: its start is then refused with
  ``insufficient_memory`` and the figures (LIFE-3).

Among the slots left, ``spread`` takes the machine with the fewest instances
of the deployment (then the device with the fewest, then the most memory free
now), ``pack`` the machine with the most instances below its cap (then the
same); names break what is left, so the same state gives the same answer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from capyctl.domain.deployments import DeploymentSpec, InstancePlace
from capyctl.domain.hosts import HostState

SERVER = "this machine"  # how reasons name the server's own machine


class Slot(NamedTuple):
    """One place an instance could go: a machine (``host`` None: the server's own), a device on it (None:
    not accounted), the host's state (None for the server), the device's usable bytes and bytes free now
    (None: not accounted)."""

    host: str | None
    device: str | None
    state: HostState | None = None
    usable: int | None = None
    free: int | None = None
    draining: bool = False  # an operator drained its host
    leaving: bool = False  # its host's instances are being moved off it (drained, lost or revoked)


class Placed(NamedTuple):
    """The outcome of ``place``: where each new instance goes, by index, and a reason for each left out."""

    places: list[InstancePlace]
    unplaced: list[str]


def _where(host: str | None, device: str | None) -> str:
    machine = SERVER if host is None else f"host {host}"
    return machine if device is None else f"{machine} device {device}"


def _refusal(spec: DeploymentSpec, slot: Slot, on_host: int, on_device: int, memory_counts: bool = True) -> str | None:
    """Why ``slot`` cannot take one more instance of ``spec`` now; None when it can."""
    where = _where(slot.host, slot.device)
    if spec.allowed_hosts and slot.host not in spec.allowed_hosts:
        return f"{where}: not in placement.hosts"
    if spec.allowed_devices and slot.device is not None and slot.device not in spec.allowed_devices:
        return f"{where}: not in placement.devices"
    if slot.state is HostState.REVOKED:
        return f"{where}: revoked"
    if slot.draining:
        return f"{where}: drained by an operator (capyctl undrain host {slot.host})"
    if slot.leaving:
        return f"{where}: its instances are being moved off it"
    if slot.state is not None and slot.state is not HostState.ONLINE and slot.host != spec.host:
        return f"{where}: {slot.state}, not online"
    cap = spec.placement.max_per_host
    if cap is not None and on_host >= cap:
        return f"{where}: runs {on_host} instance{'s' if on_host != 1 else ''} already (placement.max_per_host)"
    memory = spec.resources.memory_bytes
    if memory_counts and memory is not None and slot.usable is not None and memory * (on_device + 1) > slot.usable:
        held = f" beside {on_device} instance{'s' if on_device != 1 else ''} of it" if on_device else ""
        return f"{where}: needs {memory} bytes{held}, the device has {slot.usable} usable"
    return None


def _ranked(
    spec: DeploymentSpec,
    slots: Sequence[Slot],
    on_host: dict[str | None, int],
    on_device: dict[tuple[str | None, str | None], int],
    memory: int,
    memory_counts: bool,
) -> tuple[list[tuple[tuple[int, int, int, str, str], Slot]], list[str]]:
    """The slots that can take one more instance, each with its rank (the least first), and the refusals."""
    ranked: list[tuple[tuple[int, int, int, str, str], Slot]] = []
    reasons: list[str] = []
    for slot in slots:
        host_count = on_host.get(slot.host, 0)
        device_count = on_device.get((slot.host, slot.device), 0)
        refusal = _refusal(spec, slot, host_count, device_count, memory_counts)
        if refusal is not None:
            reasons.append(refusal)
            continue
        free = 0 if slot.free is None else slot.free - memory * device_count
        machine = host_count if spec.placement.strategy == "spread" else -host_count
        ranked.append(((machine, device_count, -free, slot.host or "", slot.device or ""), slot))
    return ranked, reasons


def place(
    spec: DeploymentSpec, slots: Sequence[Slot], placed: Sequence[InstancePlace], indexes: Sequence[int]
) -> Placed:
    """Where each instance of ``indexes`` goes, beside the instances ``placed`` already (see the module)."""
    on_host: dict[str | None, int] = {}
    on_device: dict[tuple[str | None, str | None], int] = {}
    for where in placed:
        on_host[where.host] = on_host.get(where.host, 0) + 1
        on_device[(where.host, where.device)] = on_device.get((where.host, where.device), 0) + 1
    memory = spec.resources.memory_bytes or 0
    places: list[InstancePlace] = []
    unplaced: list[str] = []
    for index in indexes:
        ranked, reasons = _ranked(spec, slots, on_host, on_device, memory, True)
        if not ranked and not placed and not places:  # none can ever hold it: the first is placed all the same,
            ranked, _ = _ranked(spec, slots, on_host, on_device, memory, False)  # its start refused (LIFE-3)
        if not ranked:
            why = "; ".join(reasons) if reasons else "no machine has its engine"
            unplaced.append(f"instance {index}: no place: {why}")
            continue
        slot = min(ranked)[1]
        places.append(InstancePlace(index=index, host=slot.host, device=slot.device))
        on_host[slot.host] = on_host.get(slot.host, 0) + 1
        on_device[(slot.host, slot.device)] = on_device.get((slot.host, slot.device), 0) + 1
    return Placed(places, unplaced)
