"""The dashboard's Litestar application: sign-in, the pages, the actions and the live stream.

Paths (all under ``/ui``; ``/`` redirects to the fleet):

- ``POST /ui/sign-ins`` (admin token, for ``capyctl dashboard``): a one-time sign-in link;
- ``GET /ui/sign-in`` and ``POST /ui/sign-in`` (the admin token), ``GET /ui/sign-in/{token}`` (the link),
  ``POST /ui/sign-out``;
- ``GET /ui/``, ``/ui/memory``, ``/ui/keys``, ``/ui/events``, ``/ui/logs/{deployment}/{file}``: pages;
- ``GET /ui/deployments/{name}/{action}``: what the action will do, and the form that does it (``POST``);
- ``GET /ui/stream?page=...``: the page's live stream; ``GET /ui/static/...``: the assets.

Every page, action and stream needs a session (401 and the sign-in page
otherwise); every POST of a session needs its CSRF token (403 otherwise).
"""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import quote

import anyio
import jinja2
from litestar import Litestar, Request, Response, get, post
from litestar.connection import ASGIConnection
from litestar.datastructures import Cookie, State
from litestar.exceptions import HTTPException
from litestar.handlers.base import BaseRouteHandler
from litestar.response import Redirect, ServerSentEvent

from capyctl.adapters.dashboard.assets import load_assets
from capyctl.adapters.dashboard.board import LOG_NAME, PAGES, Board
from capyctl.adapters.dashboard.live import MAX_STREAMS, Hub, stream
from capyctl.adapters.dashboard.security import guarded
from capyctl.adapters.dashboard.sessions import Session, Sessions, SignIns, admin_token_ok
from capyctl.adapters.dashboard.views import ACTIONS, consequences, card
from capyctl.adapters.http.asgi import REQUEST_ID_KEY, with_request_ids
from capyctl.adapters.http.errors import envelope, status_of
from capyctl.domain.deployments import NAME_PATTERN
from capyctl.domain.errors import CapyError, InternalError, InvalidRequest, NotFound, Unauthorized
from capyctl.domain.memory import gib
from capyctl.services.events import Events

log = logging.getLogger("capyctl.dashboard")
COOKIE = "capyctl_session"
LOG_TAIL = 64 * 1024  # bytes of a launch log shown
HTML = "text/html; charset=utf-8"
NO_STORE = {"cache-control": "no-store"}


class SignInNeeded(CapyError):
    code = "sign_in_needed"


class CsrfRefused(CapyError):
    code = "csrf_refused"


class NotNow(CapyError):
    code = "action_not_allowed"


class TooManyStreams(CapyError):
    code = "too_many_streams"


STATUS = {"sign_in_needed": 401, "csrf_refused": 403, "action_not_allowed": 409, "too_many_streams": 503}


@dataclass
class Dashboard:
    """What the handlers read: the board, the sessions, where links point, and the server's stop."""

    board: Board
    sessions: Sessions
    signins: SignIns
    events: Events
    admin_token: str
    base_url: str  # http://host:port of this listener, for sign-in links
    stopping: anyio.Event
    templates: jinja2.Environment
    assets: dict[str, tuple[bytes, str]]


def _stamp(wall: float) -> str:
    return datetime.fromtimestamp(wall, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def templates() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
                             autoescape=True, undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["gib"] = gib
    env.filters["stamp"] = _stamp
    env.filters["clock"] = lambda wall: datetime.fromtimestamp(wall, timezone.utc).strftime("%H:%M:%S UTC")
    env.filters["iso"] = lambda wall: datetime.fromtimestamp(wall, timezone.utc).isoformat(timespec="seconds")
    return env


def _dash(request: Request[Any, Any, Any]) -> Dashboard:
    dashboard: Dashboard = request.app.state.dashboard
    return dashboard


def _session(request: Request[Any, Any, Any]) -> tuple[str, Session]:
    session_id = request.cookies.get(COOKIE, "")
    session = _dash(request).sessions.get(session_id)
    if session is None:
        raise SignInNeeded("sign in first: run `capyctl dashboard` for a one-time link, or use the admin token")
    return session_id, session


async def _checked(request: Request[Any, Any, Any]) -> tuple[Session, dict[str, str]]:
    """The session of a state-changing request, its CSRF token checked; the form's fields."""
    _, session = _session(request)
    form = await request.form()
    fields = {k: v for k, v in form.items() if isinstance(v, str)}
    given = fields.get("csrf") or request.headers.get("x-csrf-token")
    if not session.csrf_ok(given):
        raise CsrfRefused("this form's CSRF token is missing or stale: reload the page and try again")
    return session, fields


def _html(request: Request[Any, Any, Any], template: str, status: int = 200, **context: Any) -> Response[str]:
    text = _dash(request).templates.get_template(template).render(**context)
    return Response(text, status_code=status, media_type=HTML, headers=NO_STORE)


def _page(request: Request[Any, Any, Any], template: str, page: str, live: bool = True, **context: Any) -> Response[str]:
    """A page of a signed-in session; ``live``: with its event stream."""
    _, session = _session(request)
    stream = None
    if live:
        stream = f"/ui/stream?page={page}"
        if context.get("deployment"):
            stream += f"&deployment={quote(context['deployment'])}"
    return _html(request, template, page=page, session=session, live=stream, **context)


# --- sign-in ------------------------------------------------------------------------------------------
def require_admin(connection: ASGIConnection[Any, Any, Any, Any], _: BaseRouteHandler) -> None:
    """The management API's own check (``Authorization: Bearer <admin token>``, constant time)."""
    token: str = connection.app.state.admin_token
    given = connection.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), f"Bearer {token}".encode()):
        raise Unauthorized()


@post("/ui/sign-ins", guards=[require_admin], status_code=201, sync_to_thread=False)
def issue_sign_in(request: Request[Any, Any, Any]) -> dict[str, Any]:
    """For ``capyctl dashboard`` (admin token): a sign-in link good once, for a minute."""
    dash = _dash(request)
    return {"url": f"{dash.base_url}/ui/sign-in/{dash.signins.issue()}", "expires_in_s": 60}


def _signed_in(request: Request[Any, Any, Any], how: str) -> Response[str]:
    session_id, session = _dash(request).sessions.open(how)
    log.info("dashboard session %s opened (%s)", session.label, how)
    return Redirect("/ui/", status_code=303, headers=NO_STORE, cookies=[Cookie(
        key=COOKIE, value=session_id, path="/", httponly=True, samesite="strict", secure=False)])


@get("/ui/sign-in", sync_to_thread=False)
def sign_in_page(request: Request[Any, Any, Any]) -> Response[str]:
    return _html(request, "signin.html", page="sign in", session=None, live=None, message=None)


@post("/ui/sign-in", status_code=303)
async def sign_in_with_token(request: Request[Any, Any, Any]) -> Response[str]:
    form = await request.form()
    token = form.get("token")
    if isinstance(token, str) and admin_token_ok(token, _dash(request).admin_token):
        return _signed_in(request, "admin token")
    return _html(request, "signin.html", 401, page="sign in", session=None, live=None,
                 message="That is not this server's admin token (API keys do not sign in).")


@get("/ui/sign-in/{token:str}", sync_to_thread=False)
def sign_in_with_link(request: Request[Any, Any, Any], token: str) -> Response[str]:
    if _dash(request).signins.redeem(token):
        return _signed_in(request, "one-time link")
    return _html(request, "signin.html", 401, page="sign in", session=None, live=None,
                 message="This sign-in link was used already or has expired (a link works once, for 60 s): "
                         "run `capyctl dashboard` again for a new one.")


@post("/ui/sign-out", status_code=303)
async def sign_out(request: Request[Any, Any, Any]) -> Response[str]:
    session, _ = await _checked(request)
    _dash(request).sessions.close(request.cookies.get(COOKIE))
    log.info("dashboard session %s closed", session.label)
    response: Response[str] = Redirect("/ui/sign-in", status_code=303, headers=NO_STORE)
    response.delete_cookie(COOKIE, path="/")
    return response


# --- pages --------------------------------------------------------------------------------------------
@get("/", sync_to_thread=False)
def root() -> Response[str]:
    return Redirect("/ui/", status_code=303)


@get("/ui/", sync_to_thread=False)
def fleet_page(request: Request[Any, Any, Any]) -> Response[str]:
    return _page(request, "fleet.html", "fleet", cards=_dash(request).board.cards())


@get("/ui/memory", sync_to_thread=False)
def memory_page(request: Request[Any, Any, Any]) -> Response[str]:
    return _page(request, "memory.html", "memory", bars=_dash(request).board.snapshot("memory")["memory"])


@get("/ui/keys", sync_to_thread=False)
def keys_page(request: Request[Any, Any, Any]) -> Response[str]:
    return _page(request, "keys.html", "keys", keys=_dash(request).board.key_rows())


@get("/ui/events")
async def events_page(request: Request[Any, Any, Any], deployment: str | None = None) -> Response[str]:
    _session(request)
    board = _dash(request).board
    await board.timeline.ensure_seeded()
    groups = board.snapshot("events", deployment)["events"]
    return _page(request, "events.html", "events", groups=groups, deployment=deployment)


@get("/ui/logs/{deployment:str}/{file:str}", sync_to_thread=False)
def log_page(request: Request[Any, Any, Any], deployment: str, file: str) -> Response[str]:
    _session(request)
    root = _dash(request).board.log_root
    path = root / deployment / file
    if not NAME_PATTERN.fullmatch(deployment) or not LOG_NAME.fullmatch(file) or not path.is_file():
        raise NotFound(f"no launch log {file!r} for {deployment!r} (logs are kept under logs/<deployment>/)")
    with path.open("rb") as handle:
        size = handle.seek(0, 2)
        handle.seek(max(0, size - LOG_TAIL))
        tail = handle.read()
    return _page(request, "log.html", "events", live=False, deployment=deployment, file=file, size=size, shown=len(tail),
                 cut=size > len(tail), text=tail.decode("utf-8", "replace"))


# --- actions ------------------------------------------------------------------------------------------
def _action(request: Request[Any, Any, Any], name: str, action: str) -> tuple[Any, Any]:
    if action not in ACTIONS:
        raise NotFound(f"no action {action!r}: the dashboard can {', '.join(ACTIONS)} a deployment")
    board = _dash(request).board
    controller = board.fleet.get(name)
    status = controller.status
    shown = card(controller, board.admission, board.since(name, str(status.state), status.ready_at,
                                                          status.started_at), board.clock.wall())
    return controller, shown


@get("/ui/deployments/{name:str}/{action:str}", sync_to_thread=False)
def confirm_page(request: Request[Any, Any, Any], name: str, action: str) -> Response[str]:
    _session(request)
    controller, shown = _action(request, name, action)
    board = _dash(request).board
    lines = consequences(action, controller, board.admission, board.fleet.room, board.fleet.controllers())
    return _page(request, "confirm.html", "fleet", live=False, action=action, card=shown, lines=lines,
                 allowed=shown.action(action))


@post("/ui/deployments/{name:str}/{action:str}", status_code=303)
async def do_action(request: Request[Any, Any, Any], name: str, action: str) -> Response[str]:
    session, _ = await _checked(request)
    _, shown = _action(request, name, action)
    allowed = shown.action(action)
    if not allowed.allowed:
        raise NotNow(f"cannot {action} {name} now: {allowed.why_not}")
    dash = _dash(request)
    dash.events.emit(name, "dashboard_action", action=action, session=session.label)
    try:
        await getattr(dash.board.fleet, action)(name)
    except CapyError as error:
        dash.events.emit(name, "dashboard_action_failed", action=action, session=session.label, code=error.code)
        raise
    return Redirect("/ui/", status_code=303, headers=NO_STORE)


# --- live and static ------------------------------------------------------------------------------------
@get("/ui/stream")
async def live(request: Request[Any, Any, Any], page: str = "fleet", deployment: str | None = None) -> ServerSentEvent:
    session_id, _ = _session(request)
    if page not in PAGES:
        raise InvalidRequest(f"page must be one of {', '.join(PAGES)}", param="page")
    dash = _dash(request)
    board, hub = dash.board, dash.board.hub
    if hub.streams >= MAX_STREAMS:
        raise TooManyStreams(f"{MAX_STREAMS} dashboard streams are open already; close some pages")
    if page == "events":
        await board.timeline.ensure_seeded()
    env = dash.templates

    def render(name: str, now: dict[str, Any]) -> str:
        if name == "cards":
            return env.get_template("_cards.html").render(cards=[now[f"card-{n}"] for n in now["cards"]])
        if name.startswith("card-"):
            return env.get_template("_card.html").render(c=now[name])
        context = {"memory": {"bars": now.get("memory")}, "keys": {"keys": now.get("keys")},
                   "events": {"groups": now.get("events"), "deployment": deployment}}[name]
        return env.get_template(f"_{name}.html").render(**context)

    async def messages() -> Any:
        with hub.feed() as feed:
            alive = lambda: dash.sessions.get(session_id) is not None  # noqa: E731
            async for message in stream(feed, lambda: board.snapshot(page, deployment), render, alive,
                                        dash.stopping):
                yield message

    return ServerSentEvent(messages())  # Litestar adds cache-control: no-cache and x-accel-buffering: no


@get("/ui/static/{path:path}", sync_to_thread=False)
def static(request: Request[Any, Any, Any], path: str) -> Response[bytes]:
    found = _dash(request).assets.get(path.lstrip("/"))
    if found is None:
        raise NotFound(f"no static file {path!r}")
    return Response(found[0], media_type=found[1], headers={"cache-control": "no-cache"})


# --- errors -------------------------------------------------------------------------------------------
def _wants_html(request: Request[Any, Any, Any]) -> bool:
    return request.url.path != "/ui/sign-ins" and request.url.path != "/ui/stream"


def error_page(request: Request[Any, Any, Any], error: CapyError) -> Response[Any]:
    status = STATUS.get(error.code) or status_of(error)
    if not _wants_html(request):
        return Response(envelope(error), status_code=status, headers=NO_STORE)
    if isinstance(error, SignInNeeded):
        return _html(request, "signin.html", 401, page="sign in", session=None, live=None, message=None)
    session = _dash(request).sessions.get(request.cookies.get(COOKIE, ""))
    return _html(request, "error.html", status, page="error", session=session, live=None, http_status=status,
                 title={401: "Sign in first", 403: "Refused", 404: "Not found", 409: "Not now"}.get(status, "Error"),
                 code=error.code, message=error.message)


def http_error_page(request: Request[Any, Any, Any], error: HTTPException) -> Response[Any]:
    if error.status_code == 404:
        return error_page(request, NotFound(f"no dashboard page {request.url.path}"))
    wrapped = CapyError(str(error.detail))
    wrapped.code = "invalid_request" if error.status_code < 500 else "internal_error"
    return error_page(request, wrapped)


def unexpected_error_page(request: Request[Any, Any, Any], error: Exception) -> Response[Any]:
    request_id = request.scope.get(REQUEST_ID_KEY, "-")  # type: ignore[call-overload]
    log.error("request %s: internal error on %s %s", request_id, request.method, request.url.path, exc_info=error)
    return error_page(request, InternalError(request_id))


def create_dashboard_app(dashboard: Dashboard, hosts: frozenset[str]) -> Any:
    """The dashboard's ASGI application, behind the Host check and the security headers."""
    app = Litestar(
        route_handlers=[issue_sign_in, sign_in_page, sign_in_with_token, sign_in_with_link, sign_out, root,
                        fleet_page, memory_page, keys_page, events_page, log_page, confirm_page, do_action, live,
                        static],
        exception_handlers={CapyError: error_page, HTTPException: http_error_page, Exception: unexpected_error_page},
        openapi_config=None,
        logging_config=None,
        state=State({"dashboard": dashboard, "admin_token": dashboard.admin_token}),
    )
    return with_request_ids(guarded(app, hosts))


def build_dashboard(board: Board, events: Events, admin_token: str, base_url: str, stopping: anyio.Event) -> Dashboard:
    """The dashboard's parts; its hub listens to the events from here on."""
    events.listen(board.hub.event)
    return Dashboard(board=board, sessions=Sessions(board.clock), signins=SignIns(board.clock), events=events,
                     admin_token=admin_token, base_url=base_url, stopping=stopping, templates=templates(),
                     assets=load_assets())


__all__ = ["Board", "Dashboard", "Hub", "build_dashboard", "create_dashboard_app"]
