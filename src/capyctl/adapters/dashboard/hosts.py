"""The Hosts page's data: each host as ``GET /hosts`` shows it (the views ``adapters.http.views.host_view``
makes, one view for both), and what revoking one or inviting one will do, in the words of their
confirmation pages.

A host's state is shown as the registry names it, whatever the name (``online``, ``suspended``, ``lost``,
``revoked``, and any state added later): the page gives each its own class and never has to know them all.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import msgspec

from capyctl.adapters.dashboard.views import coarse, counted
from capyctl.domain.errors import InvalidConfig, InvalidRequest
from capyctl.domain.joining import DEFAULT_TTL, MAX_TTL, check_host_name
from capyctl.domain.units import parse_duration

EXITS = 8  # recent engine exits shown per host, newest first


class DeviceRow(msgspec.Struct, frozen=True):
    name: str
    charged: int  # bytes the switchboard charges on it now
    capacity: int
    reserve: int


class ExitRow(msgspec.Struct, frozen=True):
    instance: str
    pid: int | None
    returncode: int | None  # None: the host could not read one
    at: float | None  # the host's wall time
    cause: str | None


class HostRow(msgspec.Struct, frozen=True):
    name: str
    state: str
    address: str | None
    version: str | None
    heard: float | None  # wall time of the last message on its link (None: not since the server started)
    age: str  # how long ago, coarse ("3 s ago"): the row changes only as often as this does
    devices: tuple[DeviceRow, ...]
    engines: tuple[str, ...]  # "name (family version)"
    deployments: tuple[str, ...]  # those whose engines run there now
    exits: tuple[ExitRow, ...]
    revoked: bool
    drain: str | None = None  # ``draining`` while a drained host still runs instances, then ``drained``


def host_row(view: dict[str, Any]) -> HostRow:
    """One host's row from its ``host_view``."""
    silent = view.get("silent_s")
    devices = tuple(
        DeviceRow(d["name"], int(d.get("charged_bytes", 0)), int(d["capacity_bytes"]), int(d.get("reserve_bytes", 0)))
        for d in view.get("devices", ())
    )
    engines = tuple(f"{e['name']} ({e['family']} {e['version']})" for e in view.get("engines", ()))
    exits = tuple(
        ExitRow(e.get("instance", ""), e.get("pid"), e.get("returncode"), e.get("at"), e.get("cause"))
        for e in reversed(view.get("exits", ())[-EXITS:])
    )
    return HostRow(
        name=view["name"],
        state=str(view["state"]),
        address=view.get("address"),
        version=view.get("version"),
        heard=view.get("last_heartbeat"),
        age="never since the server started" if silent is None else f"{coarse(silent)} ago",
        devices=devices,
        engines=engines,
        deployments=tuple(view.get("instances", ())),
        exits=exits,
        revoked=view.get("revoked_at") is not None,
        drain=view.get("drain"),
    )


def host_rows(views: Iterable[dict[str, Any]]) -> tuple[HostRow, ...]:
    return tuple(host_row(view) for view in views)


def revoke_lines(row: HostRow) -> list[str]:
    """What a revoke does to ``row``'s host now."""
    out = [
        f"{row.name}'s certificate is refused from now on, for ever: only a new invitation and join bring "
        "the machine back, under a new certificate.",
        f"Its control link closes now if it is up ({row.name} is {row.state}); its agent is refused whenever "
        "it dials again, and stops.",
    ]
    if row.deployments:
        out.append(
            f"Requests for the {counted(len(row.deployments), 'deployment')} running there now "
            f"({', '.join(row.deployments)}) are refused with device_offline."
        )
    else:
        out.append("No deployment runs there now.")
    return out


def drain_lines(row: HostRow, action: str) -> list[str]:
    """What a drain (``action`` ``drain``) or an undrain does to ``row``'s host now."""
    if action == "undrain":
        return [
            f"Instances may be placed on {row.name} again; those that found no place meanwhile are placed now.",
            "Nothing that runs elsewhere is moved back.",
        ]
    out = [f"Nothing new is placed on {row.name} until it is undrained."]
    if row.deployments:
        out.append(
            f"Each of the {counted(len(row.deployments), 'instance')} running there ({', '.join(row.deployments)}) "
            "gets a replacement where room exists, takes no new request, finishes those under way (within "
            "switching.drain_timeout) and stops."
        )
    else:
        out.append("No instance runs there now: it is drained at once.")
    return out


def invitation(fields: dict[str, str]) -> tuple[str, float, str | None]:
    """The host name, the TTL in seconds and the server address (None: the server's own) of an invite
    form; ``InvalidRequest`` naming the field at fault."""
    name = fields.get("name", "").strip()
    check_host_name(name)
    text = fields.get("ttl", "").strip()
    try:
        ttl = parse_duration(text, "ttl") if text else DEFAULT_TTL
    except InvalidConfig as exc:
        raise InvalidRequest(f"'ttl' must be a duration such as 15m or 1h; {exc.message}", param="ttl") from exc
    if not 0 < ttl <= MAX_TTL:
        raise InvalidRequest(f"'ttl' must be more than 0 s and at most {MAX_TTL:g} s (1 h), not {text!r}", param="ttl")
    server = fields.get("server", "").strip() or None
    return name, ttl, server


def invite_lines(name: str, ttl: float, joined: bool) -> list[str]:
    """What an invitation for ``name`` will be."""
    out = [
        f"A join file for host {name}: it works once, for {coarse(ttl)}, and only under that name.",
        "It holds a secret: the next page shows it once, and nowhere else. CapyCTL keeps only its hash.",
        f"On the machine: capyctl join host --join-file {name}.join, then capyctl start host.",
    ]
    if joined:
        out.append(
            f"{name} has joined already: a join with this file replaces its certificate, and the old one "
            "is refused from then on."
        )
    return out
