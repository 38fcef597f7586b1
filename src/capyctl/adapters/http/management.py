"""The management API (127.0.0.1:7443 by default), behind the admin token.

The CLI is its client: every ``capyctl`` command other than ``start
standalone`` is one or a few calls here.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable
from typing import Any

from litestar import Litestar, delete, get, post, put
from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.di import NamedDependency, Provide
from litestar.handlers.base import BaseRouteHandler
from litestar.params import SkipValidation

from capyctl.adapters.http.asgi import with_request_ids
from capyctl.adapters.http.inference import error_handlers
from capyctl.adapters.http.records_api import HANDLERS as RECORD_HANDLERS
from capyctl.adapters.http.views import (
    ClockDep,
    FleetDep,
    deployment_view,
    devices_view,
    engine_view,
    host_view,
    key_view,
)
from capyctl.domain.errors import InvalidConfig, InvalidRequest, Unauthorized
from capyctl.domain.ports import Clock
from capyctl.services.fleet import Fleet
from capyctl.services.keys import Keyring
from capyctl.services.request_log import RequestLog
from capyctl.services.server_hosts import HostRegistry

KeysDep = NamedDependency[SkipValidation[Keyring]]
_KEY_FIELDS = ("name", "daily_limit", "models", "cache_salt")


def require_admin(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    token: str = connection.app.state.admin_token
    given = connection.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
        raise Unauthorized()


def _text(data: dict[str, Any], key: str, required: bool = True) -> str | None:
    value = data.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"{key!r} must be a non-empty string")
    return value


@get("/engines", sync_to_thread=False)
def list_engines(fleet: FleetDep) -> list[dict[str, Any]]:
    return [engine_view(e) for e in fleet.list_engines()]


@post("/engines", status_code=201)
async def add_engine(fleet: FleetDep, data: dict[str, Any]) -> dict[str, Any]:
    path = _text(data, "path")
    family = _text(data, "family", required=False)
    engine = await fleet.add_engine(path or "", _text(data, "name", required=False), family)
    return engine_view(engine)


@delete("/engines/{name:str}", status_code=200, sync_to_thread=False)
def remove_engine(fleet: FleetDep, name: str) -> dict[str, Any]:
    fleet.remove_engine(name)
    return {"removed": name}


@get("/deployments", sync_to_thread=False)
def list_deployments(fleet: FleetDep, clock: ClockDep) -> list[dict[str, Any]]:
    now = clock.wall()
    return [deployment_view(s, now, fleet.room, clock.monotonic()) for s in fleet.deployments()]


@put("/deployments", status_code=200)
async def apply_deployment(fleet: FleetDep, clock: ClockDep, data: dict[str, Any]) -> dict[str, Any]:
    activate = data.get("activate", False)
    if not isinstance(activate, bool):
        raise InvalidRequest("'activate' must be true or false")
    outcome, controller = await fleet.apply(data.get("document"), activate)
    return {"outcome": outcome, "deployment": deployment_view(controller, clock.wall(), fleet.room, clock.monotonic())}


@get("/deployments/{name:str}", sync_to_thread=False)
def get_deployment(fleet: FleetDep, clock: ClockDep, name: str) -> dict[str, Any]:
    return deployment_view(fleet.get(name), clock.wall(), fleet.room, clock.monotonic())


@post("/deployments/{name:str}/start", status_code=200)
async def start_deployment(fleet: FleetDep, clock: ClockDep, name: str) -> dict[str, Any]:
    return deployment_view(await fleet.start(name), clock.wall(), fleet.room, clock.monotonic())


@post("/deployments/{name:str}/stop", status_code=200)
async def stop_deployment(fleet: FleetDep, clock: ClockDep, name: str) -> dict[str, Any]:
    return deployment_view(await fleet.stop(name), clock.wall(), fleet.room, clock.monotonic())


@post("/deployments/{name:str}/park", status_code=200)
async def park_deployment(fleet: FleetDep, clock: ClockDep, name: str) -> dict[str, Any]:
    return deployment_view(await fleet.park(name), clock.wall(), fleet.room, clock.monotonic())


@get("/devices", sync_to_thread=False)
def list_devices(fleet: FleetDep) -> list[dict[str, Any]]:
    return devices_view(fleet.room)


@delete("/deployments/{name:str}", status_code=200)
async def delete_deployment(fleet: FleetDep, name: str) -> dict[str, Any]:
    await fleet.delete(name)
    return {"deleted": name}


@get("/events", sync_to_thread=False)
def list_events(
    fleet: FleetDep, deployment: str | None = None, after: int = 0, limit: int = 200
) -> list[dict[str, Any]]:
    if not 0 <= after < 2**63:
        raise InvalidRequest("'after' must be an event ID: a whole number from 0", param="after")
    return fleet.events(deployment, after, min(max(limit, 1), 1000))


@post("/keys", status_code=201, sync_to_thread=False)
def create_key(keys: KeysDep, data: dict[str, Any]) -> dict[str, Any]:
    """A new named key; the answer is the only place its secret is ever shown."""
    for field in data:
        if field not in _KEY_FIELDS:
            raise InvalidRequest(f"{field!r} is not a field of a key; it takes {', '.join(_KEY_FIELDS)}", param=field)
    key, secret = keys.create(data.get("name"), data.get("daily_limit"), data.get("models"), data.get("cache_salt"))
    return {**key_view(*keys.get(key.name)), "secret": secret}


@get("/keys", sync_to_thread=False)
def list_keys(keys: KeysDep) -> list[dict[str, Any]]:
    return [key_view(key, usage) for key, usage in keys.with_usage()]


@get("/keys/{name:str}", sync_to_thread=False)
def get_key(keys: KeysDep, name: str) -> dict[str, Any]:
    return key_view(*keys.get(name))


@delete("/keys/{name:str}", status_code=200, sync_to_thread=False)
def revoke_key(keys: KeysDep, name: str) -> dict[str, Any]:
    key = keys.revoke(name)
    return {"revoked": key.name, "id": key.id}


HostsDep = NamedDependency[SkipValidation["Hosts | None"]]


class Hosts:
    """What the management API needs of several machines: the registry, and how an invitation is made
    (its secret, the join file around it: the composition root's)."""

    def __init__(self, registry: HostRegistry, invite: Callable[[str, float, str | None], dict[str, Any]]) -> None:
        self.registry = registry
        self.invite = invite


def _hosts(hosts: Hosts | None) -> Hosts:
    if hosts is None:
        raise InvalidConfig("this CapyCTL runs standalone: hosts join a server started with `capyctl start server`")
    return hosts


@get("/hosts", sync_to_thread=False)
def list_hosts(hosts: HostsDep, fleet: FleetDep) -> list[dict[str, Any]]:
    return [host_view(view, fleet) for view in _hosts(hosts).registry.views()]


@get("/hosts/{name:str}", sync_to_thread=False)
def get_host(hosts: HostsDep, fleet: FleetDep, name: str) -> dict[str, Any]:
    return host_view(_hosts(hosts).registry.view(name), fleet)


@post("/hosts/invites", status_code=201, sync_to_thread=False)
def invite_host(hosts: HostsDep, data: dict[str, Any]) -> dict[str, Any]:
    """A join file for one host; the answer is the only place its secret is ever shown."""
    for field in data:
        if field not in ("name", "ttl_s", "server"):
            raise InvalidRequest(
                f"{field!r} is not a field of an invitation; it takes name, ttl_s, server", param=field
            )
    ttl = data.get("ttl_s", 900.0)
    if isinstance(ttl, bool) or not isinstance(ttl, int | float):
        raise InvalidRequest("'ttl_s' must be a number of seconds", param="ttl_s")
    return _hosts(hosts).invite(_text(data, "name") or "", float(ttl), _text(data, "server", required=False))


@post("/hosts/{name:str}/engines", status_code=201)
async def add_host_engine(hosts: HostsDep, name: str, data: dict[str, Any]) -> dict[str, Any]:
    for field in data:
        if field not in ("path", "name", "family"):
            raise InvalidRequest(f"{field!r} is not a field of an engine; it takes path, name, family", param=field)
    engine = await _hosts(hosts).registry.add_engine(
        name, _text(data, "path") or "", _text(data, "name", required=False), _text(data, "family", required=False)
    )
    return {**engine_view(engine), "host": name}


@post("/hosts/{name:str}/drain", status_code=200)
async def drain_host(hosts: HostsDep, fleet: FleetDep, name: str) -> dict[str, Any]:
    _hosts(hosts).registry.state(name)  # host_not_found for a name no host joined under
    await fleet.drain_host(name)
    return host_view(_hosts(hosts).registry.view(name), fleet)


@post("/hosts/{name:str}/undrain", status_code=200)
async def undrain_host(hosts: HostsDep, fleet: FleetDep, name: str) -> dict[str, Any]:
    _hosts(hosts).registry.state(name)
    await fleet.undrain_host(name)
    return host_view(_hosts(hosts).registry.view(name), fleet)


@delete("/hosts/{name:str}", status_code=200)
async def revoke_host(hosts: HostsDep, name: str) -> dict[str, Any]:
    record = await _hosts(hosts).registry.revoke(name)
    return {"revoked": record.name, "revoked_at": record.revoked_at}


def create_management_app(
    fleet: Fleet,
    clock: Clock,
    admin_token: str,
    keys: Keyring,
    records: RequestLog | None = None,
    hosts: Hosts | None = None,
) -> Callable[..., Any]:
    return with_request_ids(
        Litestar(
            route_handlers=[
                list_engines,
                add_engine,
                remove_engine,
                list_deployments,
                apply_deployment,
                get_deployment,
                start_deployment,
                stop_deployment,
                park_deployment,
                list_devices,
                delete_deployment,
                list_events,
                create_key,
                list_keys,
                get_key,
                revoke_key,
                list_hosts,
                get_host,
                invite_host,
                add_host_engine,
                drain_host,
                undrain_host,
                revoke_host,
                *(RECORD_HANDLERS if records is not None else ()),
            ],
            guards=[require_admin],
            dependencies={
                "fleet": Provide(lambda: fleet, sync_to_thread=False),
                "clock": Provide(lambda: clock, sync_to_thread=False),
                "keys": Provide(lambda: keys, sync_to_thread=False),
                "records": Provide(lambda: records, sync_to_thread=False),
                "hosts": Provide(lambda: hosts, sync_to_thread=False),
            },
            exception_handlers=error_handlers(),
            openapi_config=None,
            logging_config=None,
            state=State({"admin_token": admin_token}),
        )
    )
