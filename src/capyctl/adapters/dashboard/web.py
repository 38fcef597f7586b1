"""What the dashboard's handlers share: its parts, the templates, the session checks, the error pages.

Every page, action and stream needs a session (``session_of``: 401 and the
sign-in page otherwise); every POST of a session needs its CSRF token
(``checked``: 403 otherwise). Errors are pages for a browser, and CapyCTL's
JSON error envelope for the stream and the management call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import anyio
import jinja2
from litestar import Request, Response
from litestar.exceptions import HTTPException

from capyctl.adapters.dashboard.board import Board
from capyctl.adapters.dashboard.requests import figure, settlement
from capyctl.adapters.dashboard.sessions import Session, Sessions, SignIns
from capyctl.adapters.dashboard.views import counted
from capyctl.adapters.http.asgi import REQUEST_ID_KEY
from capyctl.adapters.http.errors import envelope, error_type, status_of
from capyctl.domain.errors import CapyError, InternalError, MethodNotAllowed, NotFound
from capyctl.domain.memory import gib
from capyctl.services.events import Events
from capyctl.services.request_log import RequestLog

log = logging.getLogger("capyctl.dashboard")
COOKIE = "capyctl_session"
HTML = "text/html; charset=utf-8"
NO_STORE = {"cache-control": "no-store"}


class SignInNeeded(CapyError):
    code = "sign_in_needed"


class SignInRefused(CapyError):
    code = "sign_in_refused"


class CsrfRefused(CapyError):
    code = "csrf_refused"


class NotNow(CapyError):
    code = "action_not_allowed"


class TooManyStreams(CapyError):
    code = "too_many_streams"


STATUS = {
    "sign_in_needed": 401,
    "sign_in_refused": 401,
    "csrf_refused": 403,
    "action_not_allowed": 409,
    "too_many_streams": 503,
}


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
    records: RequestLog


def _stamp(wall: float) -> str:
    return datetime.fromtimestamp(wall, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def templates() -> jinja2.Environment:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["gib"] = gib
    env.filters["counted"] = counted
    env.filters["figure"] = figure
    env.filters["settlement"] = settlement
    env.filters["stamp"] = _stamp
    env.filters["clock"] = lambda wall: datetime.fromtimestamp(wall, UTC).strftime("%H:%M:%S UTC")
    env.filters["iso"] = lambda wall: datetime.fromtimestamp(wall, UTC).isoformat(timespec="seconds")
    return env


def dash(request: Request[Any, Any, Any]) -> Dashboard:
    dashboard: Dashboard = request.app.state.dashboard
    return dashboard


def session_of(request: Request[Any, Any, Any]) -> tuple[str, Session]:
    session_id = request.cookies.get(COOKIE, "")
    session = dash(request).sessions.get(session_id)
    if session is None:
        raise SignInNeeded("sign in first: run `capyctl dashboard` for a one-time link, or use the admin token")
    return session_id, session


async def checked(request: Request[Any, Any, Any]) -> tuple[Session, dict[str, str]]:
    """The session of a state-changing request, its CSRF token checked; the form's fields."""
    _, session = session_of(request)
    form = await request.form()
    fields = {k: v for k, v in form.items() if isinstance(v, str)}
    given = fields.get("csrf") or request.headers.get("x-csrf-token")
    if not session.csrf_ok(given):
        raise CsrfRefused("this form's CSRF token is missing or stale: reload the page and try again")
    return session, fields


def html(
    request: Request[Any, Any, Any],
    template: str,
    status: int = 200,
    headers: dict[str, str] | None = None,
    **context: Any,
) -> Response[str]:
    text = dash(request).templates.get_template(template).render(**context)
    return Response(text, status_code=status, media_type=HTML, headers=headers or NO_STORE)


def page(
    request: Request[Any, Any, Any],
    template: str,
    page: str,
    live: bool = True,
    stream_params: dict[str, str] | None = None,
    **context: Any,
) -> Response[str]:
    """A page of a signed-in session; ``live``: with its event stream (``stream_params``: its query's filters)."""
    _, session = session_of(request)
    stream = None
    if live:
        stream = f"/ui/stream?page={page}"
        if context.get("deployment"):
            stream += f"&deployment={quote(context['deployment'])}"
        if stream_params:
            stream += "&" + urlencode(stream_params)
    return html(request, template, page=page, session=session, live=stream, **context)


# --- errors -------------------------------------------------------------------------------------------
def wants_html(request: Request[Any, Any, Any]) -> bool:
    """A browser navigating (it accepts HTML) gets error pages; any other client CapyCTL's JSON envelope."""
    return "text/html" in request.headers.get("accept", "")


def dashboard_envelope(error: CapyError) -> tuple[int, dict[str, Any]]:
    """The status and JSON envelope of an error: the dashboard's own codes at their own statuses, with the
    ``type`` that status gives (docs/errors.md); every other code as the management API answers it."""
    body = envelope(error)
    if error.code not in STATUS:
        return status_of(error), body
    status = STATUS[error.code]
    return status, {"error": {**body["error"], "type": error_type(status)}}


def error_page(
    request: Request[Any, Any, Any], error: CapyError, headers: dict[str, str] | None = None
) -> Response[Any]:
    status, body = dashboard_envelope(error)
    headers = {**NO_STORE, **(headers or {})}
    if not wants_html(request):
        return Response(body, status_code=status, headers=headers)
    if isinstance(error, SignInNeeded | SignInRefused):
        message = error.message if isinstance(error, SignInRefused) else None
        return html(request, "signin.html", 401, page="sign in", session=None, live=None, message=message)
    session = dash(request).sessions.get(request.cookies.get(COOKIE, ""))
    return html(
        request,
        "error.html",
        status,
        headers,
        page="error",
        session=session,
        live=None,
        http_status=status,
        title={
            400: "Not understood",
            401: "Sign in first",
            403: "Refused",
            404: "Not found",
            405: "Not this way",
            409: "Not now",
        }.get(status, "Error"),
        code=error.code,
        message=error.message,
    )


def http_error_page(request: Request[Any, Any, Any], error: HTTPException) -> Response[Any]:
    if error.status_code == 404:
        return error_page(request, NotFound(f"no dashboard page {request.url.path}"))
    if error.status_code == 405:  # RFC 9110: a 405 names the methods the path takes (Litestar's router lists them)
        allow = (error.headers or {}).get("allow")
        refused = MethodNotAllowed(
            f"{request.method} is not allowed on {request.url.path}" + (f"; it takes {allow}" if allow else "")
        )
        return error_page(request, refused, {"allow": allow} if allow else None)
    wrapped = CapyError(str(error.detail))
    wrapped.code = "invalid_request" if error.status_code < 500 else "internal_error"
    return error_page(request, wrapped)


def unexpected_error_page(request: Request[Any, Any, Any], error: Exception) -> Response[Any]:
    request_id = str(request.scope.get(REQUEST_ID_KEY, "-"))  # a str: with_request_ids set it
    log.error("request %s: internal error on %s %s", request_id, request.method, request.url.path, exc_info=error)
    return error_page(request, InternalError(request_id))
