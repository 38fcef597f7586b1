"""JSON views of engines and deployments, shared by the management API and /v1/models."""

from __future__ import annotations

from typing import Any

from litestar.di import NamedDependency
from litestar.params import SkipValidation

from capyctl.domain.deployments import InstanceState
from capyctl.domain.engines import EngineInstall
from capyctl.domain.fields import row_for
from capyctl.domain.keys import ApiKey, Usage
from capyctl.domain.memory import Holding
from capyctl.domain.ports import Clock
from capyctl.services.controllers import Controller, ManagedController
from capyctl.services.fleet import Fleet
from capyctl.services.instances import InstanceSet
from capyctl.services.switching import NoSwitchboard, Switchboard


def engine_view(engine: EngineInstall) -> dict[str, Any]:
    return {
        "name": engine.name,
        "family": str(engine.family),
        "version": engine.version,
        "path": engine.path,
        "version_text": engine.version_text,
    }


def memory_view(found: InstanceSet, room: Switchboard | NoSwitchboard) -> dict[str, Any]:
    """What the deployment declares, and what its first placed instance holds on its device (each instance's
    own device and charge are in its row of ``instances``); ``device`` None when it is not accounted."""
    resources = found.spec.resources
    lead = found.members[0] if found.members else None
    device = room.device_of(lead) if lead is not None else None
    holding = lead.holding if isinstance(lead, ManagedController) else Holding.NONE
    return {
        "device": None if device is None else device.name,
        "memory_bytes": resources.memory_bytes,
        "parked_memory_bytes": resources.parked_bytes if resources.parked_memory is not None else None,
        "holding": str(holding),
        "charged_bytes": 0 if device is None or lead is None else room.charged(device).get(lead.holder, 0),
        "last_switch": None if device is None else room.last_switch.get(device.name),  # on its device
    }


def devices_view(room: Switchboard | NoSwitchboard) -> list[dict[str, Any]]:
    out = []
    for device in room.every_device():
        charged = room.charged(device)
        out.append(
            {
                "name": device.name,
                "capacity_bytes": device.capacity,
                "reserve_bytes": device.reserve,
                "charged_bytes": sum(charged.values()),
                "free_bytes": device.usable - sum(charged.values()),
                "holders": [{"deployment": name, "bytes": size} for name, size in sorted(charged.items())],
                "last_switch": room.last_switch.get(device.name),
            }
        )
    return out


def instance_view(controller: Controller, now: float, room: Switchboard | NoSwitchboard) -> dict[str, Any]:
    """One instance: where it runs, its state, its load and what it still counts of cut requests."""
    status = controller.status
    running = status.state in (InstanceState.READY, InstanceState.STARTING) and status.started_at
    held = controller.held()  # its host is out of reach: the engine is held, neither serving nor released
    device = room.device_of(controller)
    sample = controller.sample
    return {
        "index": status.index,
        "state": "held" if held is not None else str(status.state),
        "held": None if held is None else {"reason": held.extra.get("reason"), "message": held.message},
        "host": controller.host,
        "device": controller.device if device is None else device.name,
        "draining": controller.draining,
        "retired": False,  # (a retired one: being replaced, stopped once its engine is gone)
        "pid": status.pid,
        "port": status.port,  # the engine's, on its machine's loopback
        "ingress_port": status.ingress_port,  # on a host: where the server reaches it
        "uptime_s": round(now - status.ready_at, 1)
        if status.state is InstanceState.READY and status.ready_at and held is None
        else None,
        "started_at": status.started_at if running else None,
        "restarts": status.restarts,
        "last_error": status.last_error,
        "log": status.log_path,
        "in_flight": controller.in_flight,
        "engine_load": None if sample is None else {"running": sample.running, "waiting": sample.waiting},
        "engine_load_at": None if sample is None else sample.at,  # (monotonic; the API adds its age)
        "charged_bytes": 0 if device is None else room.charged(device).get(controller.holder, 0),
        "unsettled": controller.settlement.ledger.counts(),
        "cold_starts_s": [round(x, 3) for x in status.cold_starts],  # measured spawn -> ready, last 20
        "wake_times_s": [round(x, 3) for x in status.wake_times],  # measured wakes, last 20
    }


def deployment_view(
    found: InstanceSet, now: float, room: Switchboard | NoSwitchboard, monotonic: float | None = None
) -> dict[str, Any]:
    """A deployment and its instances; its ``state`` is that of its most useful instance (a ready one first).
    ``monotonic``: the clock's monotonic now, for the age of each engine load sample."""
    spec = found.deployment.spec
    engine = found.engine
    fields = found.members[0].fields if found.members else row_for(engine.family, engine.version)
    instances = [instance_view(c, now, room) for c in found.members]
    instances += [instance_view(c, now, room) | {"retired": True} for c in found.retired]
    for shown in instances:
        at = shown.pop("engine_load_at")
        shown["engine_load_age_s"] = None if at is None or monotonic is None else round(max(0.0, monotonic - at), 3)
    return {
        "name": spec.name,
        "api": spec.api,
        "engine": spec.engine,
        "engine_family": str(engine.family),
        "engine_version": engine.version,
        "model": spec.model,
        "endpoint": spec.endpoint,
        "host": found.deployment.host,
        "state": str(found.state),
        "fields": fields.describe(engine.version),
        "desired": str(found.desired),
        "residency": str(spec.residency),
        "memory": memory_view(found, room),
        "operator_stopped": found.deployment.operator_stopped,
        "engine_config": {
            "context_length": spec.engine_config.context_length,
            "extra_args": list(spec.engine_config.extra_args),
        },
        "instances_wanted": spec.instances,
        "placement": {
            "hosts": spec.allowed_hosts,
            "devices": spec.allowed_devices,
            "strategy": spec.placement.strategy,
            "max_per_host": spec.placement.max_per_host,
        },
        "unplaced": list(found.unplaced),
        "instances": instances,
    }


# Handler parameters for services: Litestar must not try to validate them as data.
FleetDep = NamedDependency[SkipValidation[Fleet]]
ClockDep = NamedDependency[SkipValidation[Clock]]


def key_view(key: ApiKey, usage: Usage) -> dict[str, Any]:
    """A key as operators see it: never its secret, nor its salt (only whether one is bound)."""
    return {
        "name": key.name,
        "id": key.id,
        "created": key.created,
        "last_used": usage.last_used,
        "daily_limit": key.daily_limit,
        "used_today": usage.used,
        "under_way": usage.pending,
        "models": list(key.models) if key.models is not None else None,
        "cache_salt": key.cache_salt is not None,
        "legacy": key.legacy,
    }


def host_view(view: dict[str, Any], fleet: Fleet) -> dict[str, Any]:
    """A host as ``GET /hosts`` and the dashboard show it: the registry's ``view`` with what its devices hold,
    as the switchboard charges them, and the deployments whose engines run there now (its hello's list is
    what ran when it linked)."""
    view["instances"] = [c.holder for c in fleet.controllers() if c.host == view["name"] and c.status.pid is not None]
    view["drain"] = fleet.drain_state(view["name"])  # draining, drained, or None
    room = fleet.room
    if isinstance(room, Switchboard):
        devices = room.host_devices(view["name"])
        for shown in view["devices"]:
            device = devices.get(shown["name"])
            shown["charged_bytes"] = sum(room.charged(device).values()) if device is not None else 0
    return view
