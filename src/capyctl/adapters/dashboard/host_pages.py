"""The Hosts page and its two actions, each confirmed first (a page that says what it will do, whose form
does it), as the deployments' actions are:

- ``GET /ui/hosts``: every host, live;
- ``GET /ui/hosts/{name}/revoke``, ``POST`` it: ``DELETE /hosts/{name}``'s own call (``registry.revoke``);
- ``GET /ui/hosts/{name}/drain`` (or ``undrain``), ``POST`` it: ``POST /hosts/{name}/drain``'s own call
  (``Fleet.drain_host``, ``Fleet.undrain_host``);
- ``GET /ui/hosts/invite?name=&ttl=&server=``, ``POST /ui/hosts/invite``: ``POST /hosts/invites``'s own
  call (``Hosts.invite``). Its answer is the only place the join file (and its secret) is ever shown: a
  page of its own, never stored, never logged, never in a URL (the confirmation's form posts the fields).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
from litestar import Request, Response, get, post
from litestar.response import Redirect

from capyctl.adapters.dashboard.hosts import HostRow, drain_lines, invitation, invite_lines, revoke_lines
from capyctl.adapters.dashboard.web import NO_STORE, NotNow, checked, dash, page, session_of
from capyctl.domain.errors import CapyError, HostNotFound, InvalidConfig
from capyctl.domain.joining import DEFAULT_TTL

if TYPE_CHECKING:
    from capyctl.adapters.http.management import Hosts

STANDALONE = "this CapyCTL runs standalone: hosts join a server started with `capyctl start server`"


def _hosts(request: Request[Any, Any, Any]) -> Hosts:
    hosts = dash(request).board.hosts
    if hosts is None:
        raise InvalidConfig(STANDALONE)
    return hosts


def _row(request: Request[Any, Any, Any], name: str) -> HostRow:
    _hosts(request)
    row = next((r for r in dash(request).board.host_rows() or () if r.name == name), None)
    if row is None:
        raise HostNotFound(name)
    return row


@get("/ui/hosts", sync_to_thread=False)
def hosts_page(request: Request[Any, Any, Any]) -> Response[str]:
    session_of(request)
    board = dash(request).board
    return page(
        request,
        "hosts.html",
        "hosts",
        live=board.hosts is not None,
        hosts=board.host_rows(),
        default_ttl=f"{DEFAULT_TTL / 60:g}m",
    )


@get("/ui/hosts/{name:str}/revoke", sync_to_thread=False)
def revoke_page(request: Request[Any, Any, Any], name: str) -> Response[str]:
    session_of(request)
    row = _row(request, name)
    return page(request, "host_revoke.html", "hosts", live=False, host=row, lines=revoke_lines(row))


@post("/ui/hosts/{name:str}/revoke", status_code=303)
async def do_revoke(request: Request[Any, Any, Any], name: str) -> Response[str]:
    session, _ = await checked(request)
    row = _row(request, name)
    if row.revoked:
        raise NotNow(f"{name} is revoked already")
    parts = dash(request)
    parts.events.emit(None, "dashboard_action", action="revoke_host", host=name, session=session.label)
    try:
        await _hosts(request).registry.revoke(name)
    except CapyError as error:
        parts.events.emit(
            None, "dashboard_action_failed", action="revoke_host", host=name, session=session.label, code=error.code
        )
        raise
    return Redirect("/ui/hosts", status_code=303, headers=NO_STORE)


def _drain_refusal(row: HostRow, action: str) -> str | None:
    if row.revoked:
        return "it is revoked"
    if action == "drain" and row.drain is not None:
        return f"it is {row.drain} already"
    if action == "undrain" and row.drain is None:
        return "it is not drained"
    return None


@get("/ui/hosts/{name:str}/drain", sync_to_thread=False)
def drain_page(request: Request[Any, Any, Any], name: str) -> Response[str]:
    return _drain_page(request, name, "drain")


@get("/ui/hosts/{name:str}/undrain", sync_to_thread=False)
def undrain_page(request: Request[Any, Any, Any], name: str) -> Response[str]:
    return _drain_page(request, name, "undrain")


@post("/ui/hosts/{name:str}/drain", status_code=303)
async def do_drain(request: Request[Any, Any, Any], name: str) -> Response[str]:
    return await _do_drain(request, name, "drain")


@post("/ui/hosts/{name:str}/undrain", status_code=303)
async def do_undrain(request: Request[Any, Any, Any], name: str) -> Response[str]:
    return await _do_drain(request, name, "undrain")


def _drain_page(request: Request[Any, Any, Any], name: str, action: str) -> Response[str]:
    session_of(request)
    row = _row(request, name)
    return page(
        request,
        "host_drain.html",
        "hosts",
        live=False,
        host=row,
        action=action,
        lines=drain_lines(row, action),
        refusal=_drain_refusal(row, action),
    )


async def _do_drain(request: Request[Any, Any, Any], name: str, action: str) -> Response[str]:
    session, _ = await checked(request)
    row = _row(request, name)
    refusal = _drain_refusal(row, action)
    if refusal is not None:
        raise NotNow(f"{name}: {refusal}")
    parts = dash(request)
    fleet = parts.board.fleet
    parts.events.emit(None, "dashboard_action", action=f"{action}_host", host=name, session=session.label)
    try:
        await (fleet.drain_host(name) if action == "drain" else fleet.undrain_host(name))
    except CapyError as error:
        parts.events.emit(
            None, "dashboard_action_failed", action=f"{action}_host", host=name, session=session.label, code=error.code
        )
        raise
    return Redirect("/ui/hosts", status_code=303, headers=NO_STORE)


@get("/ui/hosts/invite", sync_to_thread=False)
def invite_page(request: Request[Any, Any, Any]) -> Response[str]:
    session_of(request)
    _hosts(request)
    fields = {k: v for k, v in request.query_params.items() if k in ("name", "ttl", "server")}
    name, ttl, server = invitation(fields)
    joined = any(r.name == name for r in dash(request).board.host_rows() or ())
    return page(
        request,
        "host_invite.html",
        "hosts",
        live=False,
        name=name,
        ttl=fields.get("ttl") or "",
        server=server or "",
        lines=invite_lines(name, ttl, joined),
    )


@post("/ui/hosts/invite", status_code=200)
async def do_invite(request: Request[Any, Any, Any]) -> Response[str]:
    session, fields = await checked(request)
    name, ttl, server = invitation(fields)
    parts = dash(request)
    parts.events.emit(None, "dashboard_action", action="invite_host", host=name, session=session.label)
    try:
        join = _hosts(request).invite(name, ttl, server)
    except CapyError as error:
        parts.events.emit(
            None, "dashboard_action_failed", action="invite_host", host=name, session=session.label, code=error.code
        )
        raise
    text = msgspec.json.format(msgspec.json.encode(join), indent=2).decode()
    return page(
        request, "host_invited.html", "hosts", live=False, name=name, join=text, expires_at=join.get("expires_at")
    )
