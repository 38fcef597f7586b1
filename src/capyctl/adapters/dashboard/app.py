"""The dashboard's Litestar application: the pages, the actions, the live stream and the assets.

Paths (all under ``/ui``; ``/`` redirects to the fleet):

- ``POST /ui/sign-ins`` (admin token, for ``capyctl dashboard``): a one-time sign-in link;
- ``GET /ui/sign-in`` and ``POST /ui/sign-in`` (the admin token), ``GET /ui/sign-in/{token}`` (the link),
  ``POST /ui/sign-out`` (module ``signin``);
- ``GET /ui/``, ``/ui/memory``, ``/ui/keys``, ``/ui/events``, ``/ui/logs/{deployment}/{file}``: pages;
- ``GET /ui/requests`` (filters: module ``requests``; ``?id=`` goes to the detail), ``/ui/requests/{id}``;
- ``GET /ui/charts?window=15m|1h|24h&deployment=`` (module ``charts``), its data as JSON ``/ui/charts/data``;
- ``GET /ui/deployments/{name}/{action}``: what the action will do, and the form that does it (``POST``);
- ``GET /ui/hosts``, drain, undrain, revoke and invite (module ``host_pages``);
- ``GET /ui/stream?page=...``: the page's live stream; ``GET /ui/static/...``: the assets, and
  ``/favicon.ico`` (browsers ask for it on their own).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any
from urllib.parse import quote, urlencode

import anyio
import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.datastructures import State
from litestar.exceptions import HTTPException
from litestar.response import Redirect, ServerSentEvent

from capyctl.adapters.dashboard.assets import load_assets
from capyctl.adapters.dashboard.board import LOG_NAME, PAGES, Board
from capyctl.adapters.dashboard.charts import Charts, charts, read_params
from capyctl.adapters.dashboard.host_pages import (
    do_drain,
    do_invite,
    do_revoke,
    do_undrain,
    drain_page,
    hosts_page,
    invite_page,
    revoke_page,
    undrain_page,
)
from capyctl.adapters.dashboard.live import MAX_STREAMS, stream
from capyctl.adapters.dashboard.requests import Table, chosen, fields, page_filter, query
from capyctl.adapters.dashboard.security import guarded
from capyctl.adapters.dashboard.sessions import Sessions, SignIns
from capyctl.adapters.dashboard.signin import (
    issue_sign_in,
    sign_in_page,
    sign_in_with_link,
    sign_in_with_token,
    sign_out,
)
from capyctl.adapters.dashboard.views import ACTIONS, card, consequences, unplaced_card
from capyctl.adapters.dashboard.web import (
    NO_STORE,
    Dashboard,
    NotNow,
    TooManyStreams,
    checked,
    dash,
    error_page,
    http_error_page,
    page,
    session_of,
    templates,
    unexpected_error_page,
)
from capyctl.adapters.http.asgi import with_request_ids
from capyctl.domain.deployments import NAME_PATTERN
from capyctl.domain.errors import CapyError, InvalidRequest, NotFound
from capyctl.domain.request_charts import WINDOWS
from capyctl.services.events import Events
from capyctl.services.request_log import RequestLog

LOG_TAIL = 64 * 1024  # bytes of a launch log shown


# --- pages --------------------------------------------------------------------------------------------
@get("/", sync_to_thread=False)
def root() -> Response[str]:
    return Redirect("/ui/", status_code=303)


@get("/ui/", sync_to_thread=False)
def fleet_page(request: Request[Any, Any, Any]) -> Response[str]:
    return page(request, "fleet.html", "fleet", cards=dash(request).board.cards())


@get("/ui/memory", sync_to_thread=False)
def memory_page(request: Request[Any, Any, Any]) -> Response[str]:
    return page(request, "memory.html", "memory", bars=dash(request).board.snapshot("memory")["memory"])


@get("/ui/keys", sync_to_thread=False)
def keys_page(request: Request[Any, Any, Any]) -> Response[str]:
    return page(request, "keys.html", "keys", keys=dash(request).board.key_rows())


@get("/ui/events")
async def events_page(request: Request[Any, Any, Any], deployment: str | None = None) -> Response[str]:
    session_of(request)
    board = dash(request).board
    await board.timeline.ensure_seeded()
    groups = board.snapshot("events", deployment)["events"]
    return page(request, "events.html", "events", groups=groups, deployment=deployment)


@get("/ui/requests")
async def requests_page(request: Request[Any, Any, Any]) -> Response[str]:
    session_of(request)
    parts = dash(request)
    params = query(request.query_params.multi_items())
    if "id" in params:  # the search box: a request by its X-CapyCTL-Request-Id
        wanted = params["id"].strip()
        if not wanted:
            raise InvalidRequest("'id' must not be empty: give a request's X-CapyCTL-Request-Id", param="id")
        return Redirect(f"/ui/requests/{quote(wanted, safe='')}", status_code=303, headers=NO_STORE)
    rows = await parts.records.find(page_filter(params, parts.records.wall()))
    board, form = parts.board, chosen(params)
    return page(
        request,
        "requests.html",
        "requests",
        stream_params=form,
        rows=rows,
        form=form,
        deployments=board.fleet.names(),
        keys=sorted(key.name for key, _ in board.keys.with_usage()),
    )


@get("/ui/requests/{request_id:str}")
async def request_page(request: Request[Any, Any, Any], request_id: str) -> Response[str]:
    session_of(request)
    row = await dash(request).records.get(request_id)
    if row is None:
        raise NotFound(
            f"no request record {request_id!r}: it is unknown, or older than the records keep", param="request_id"
        )
    return page(request, "request.html", "requests", live=False, row=row, fields=fields(row))


async def _charts(request: Request[Any, Any, Any]) -> tuple[Charts, str | None]:
    session_of(request)
    parts = dash(request)
    window, deployment = read_params(query(request.query_params.multi_items()))
    board = parts.board
    await board.timeline.ensure_seeded()
    board.timeline.refresh()  # the marks stored since the last read (a few rows, by their IDs)
    buckets = await parts.records.chart(window, deployment)  # (it writes what is buffered first)
    names = [n for n in board.fleet.names() if deployment in (None, n)]
    return charts(window, buckets, names, board.timeline.marks, parts.records.wall()), deployment


@get("/ui/charts")
async def charts_page(request: Request[Any, Any, Any]) -> Response[str]:
    shown, deployment = await _charts(request)
    source = "/ui/charts/data?" + urlencode(
        {"window": shown.window, **({"deployment": deployment} if deployment else {})}
    )
    return page(
        request,
        "charts.html",
        "charts",
        charts=shown,
        chosen=deployment,
        source=source,
        stream_params={"window": shown.window, **({"deployment": deployment} if deployment else {})},
        windows=list(WINDOWS),
        deployments=dash(request).board.fleet.names(),
    )


@get("/ui/charts/data")
async def charts_data(request: Request[Any, Any, Any]) -> Response[bytes]:
    shown, _ = await _charts(request)
    return Response(msgspec.json.encode(shown), media_type="application/json", headers=NO_STORE)


@get("/ui/logs/{deployment:str}/{file:str}", sync_to_thread=False)
def log_page(request: Request[Any, Any, Any], deployment: str, file: str) -> Response[str]:
    session_of(request)
    root = dash(request).board.log_root
    path = root / deployment / file
    if not NAME_PATTERN.fullmatch(deployment) or not LOG_NAME.fullmatch(file) or not path.is_file():
        raise NotFound(f"no launch log {file!r} for {deployment!r} (logs are kept under logs/<deployment>/)")
    with path.open("rb") as handle:
        size = handle.seek(0, 2)
        handle.seek(max(0, size - LOG_TAIL))
        tail = handle.read()
    return page(
        request,
        "log.html",
        "events",
        live=False,
        deployment=deployment,
        file=file,
        size=size,
        shown=len(tail),
        cut=size > len(tail),
        text=tail.decode("utf-8", "replace"),
    )


# --- actions ------------------------------------------------------------------------------------------
def _action(request: Request[Any, Any, Any], name: str, action: str) -> tuple[Any, Any]:
    if action not in ACTIONS:
        raise NotFound(f"no action {action!r}: the dashboard can {', '.join(ACTIONS)} a deployment")
    board = dash(request).board
    found = board.fleet.get(name)
    controller = found.lead
    if controller is None:  # nothing placed: only a start (which places again) can be asked
        return None, unplaced_card(found, board.admission)
    status = controller.status
    shown = card(
        controller,
        board.admission,
        board.since(name, str(status.state), status.ready_at, status.started_at),
        board.clock.wall(),
    )
    return controller, shown


@get("/ui/deployments/{name:str}/{action:str}", sync_to_thread=False)
def confirm_page(request: Request[Any, Any, Any], name: str, action: str) -> Response[str]:
    session_of(request)
    controller, shown = _action(request, name, action)
    board = dash(request).board
    lines = (
        consequences(action, controller, board.admission, board.fleet.room, board.fleet.controllers())
        if controller is not None
        else ["It places the deployment's instances again where room exists, and starts them."]
    )
    return page(
        request,
        "confirm.html",
        "fleet",
        live=False,
        action=action,
        card=shown,
        lines=lines,
        allowed=shown.action(action),
    )


@post("/ui/deployments/{name:str}/{action:str}", status_code=303)
async def do_action(request: Request[Any, Any, Any], name: str, action: str) -> Response[str]:
    session, _ = await checked(request)
    _, shown = _action(request, name, action)
    allowed = shown.action(action)
    if not allowed.allowed:
        raise NotNow(f"cannot {action} {name} now: {allowed.why_not}")
    parts = dash(request)
    parts.events.emit(name, "dashboard_action", action=action, session=session.label)
    try:
        await getattr(parts.board.fleet, action)(name)
    except CapyError as error:
        parts.events.emit(name, "dashboard_action_failed", action=action, session=session.label, code=error.code)
        raise
    return Redirect("/ui/", status_code=303, headers=NO_STORE)


# --- live and static ------------------------------------------------------------------------------------
def _reader(request: Request[Any, Any, Any], page: str, deployment: str | None) -> Callable[[], Any]:
    """How a page's stream reads its data: the board's snapshot of the page; for the Charts page, the marks in
    its window (the figures are the page's own to fetch); for the Requests page, the records, read off the
    loop and again only once new rows were stored."""
    parts = dash(request)
    board = parts.board
    if page not in ("charts", "requests"):
        return lambda: board.snapshot(page, deployment)
    params = {k: v for k, v in query(request.query_params.multi_items()).items() if k != "page"}
    if page == "charts":
        window, chosen = read_params(params)
        return lambda: board.snapshot(page, chosen, window)
    table = Table(parts.records, page_filter(params, parts.records.wall()))

    async def read_records() -> dict[str, Any]:
        return {"requests": await table.rows()}

    return read_records


@get("/ui/stream")
async def live(request: Request[Any, Any, Any], page: str = "fleet", deployment: str | None = None) -> ServerSentEvent:
    session_id, _ = session_of(request)
    if page not in PAGES:
        raise InvalidRequest(f"page must be one of {', '.join(PAGES)}", param="page")
    parts = dash(request)
    board, hub = parts.board, parts.board.hub
    if hub.streams >= MAX_STREAMS:
        raise TooManyStreams(f"{MAX_STREAMS} dashboard streams are open already; close some pages")
    if page in ("events", "charts"):
        await board.timeline.ensure_seeded()
    env = parts.templates
    read = _reader(request, page, deployment)

    def render(name: str, now: dict[str, Any]) -> str:
        if name == "cards":
            return env.get_template("_cards.html").render(cards=[now[f"card-{n}"] for n in now["cards"]])
        if name.startswith("card-"):
            return env.get_template("_card.html").render(c=now[name])
        if name.startswith("marks-"):
            return env.get_template("_marks.html").render(marks=now[name])
        context = {
            "memory": {"bars": now.get("memory")},
            "requests": {"rows": now.get("requests")},
            "keys": {"keys": now.get("keys")},
            "hosts": {"hosts": now.get("hosts")},
            "events": {"groups": now.get("events"), "deployment": deployment},
        }[name]
        return env.get_template(f"_{name}.html").render(**context)

    async def messages() -> Any:
        def alive() -> bool:
            return parts.sessions.get(session_id) is not None

        with hub.feed() as feed:
            async for message in stream(feed, read, render, alive, parts.stopping):
                yield message

    return ServerSentEvent(messages())  # Litestar adds cache-control: no-cache and x-accel-buffering: no


def _asset(request: Request[Any, Any, Any], path: str) -> Response[bytes]:
    found = dash(request).assets.get(path.lstrip("/"))
    if found is None:
        raise NotFound(f"no static file {path!r}")
    return Response(found[0], media_type=found[1], headers={"cache-control": "no-cache"})


@get("/ui/static/{path:path}", sync_to_thread=False)
def static(request: Request[Any, Any, Any], path: str) -> Response[bytes]:
    return _asset(request, path)


@get("/favicon.ico", sync_to_thread=False)
def favicon(request: Request[Any, Any, Any]) -> Response[bytes]:
    """The icon a browser asks for on its own, whatever the page says (the pages name it too)."""
    return _asset(request, "favicon.ico")


def create_dashboard_app(dashboard: Dashboard, port: int, names: frozenset[str]) -> Any:
    """The dashboard's ASGI application, behind the Host check and the security headers."""
    app = Litestar(
        route_handlers=[
            issue_sign_in,
            sign_in_page,
            sign_in_with_token,
            sign_in_with_link,
            sign_out,
            root,
            fleet_page,
            memory_page,
            requests_page,
            request_page,
            charts_page,
            charts_data,
            keys_page,
            events_page,
            log_page,
            confirm_page,
            do_action,
            hosts_page,
            revoke_page,
            do_revoke,
            drain_page,
            undrain_page,
            do_drain,
            do_undrain,
            invite_page,
            do_invite,
            live,
            static,
            favicon,
        ],
        exception_handlers={CapyError: error_page, HTTPException: http_error_page, Exception: unexpected_error_page},
        openapi_config=None,
        logging_config=None,
        state=State({"dashboard": dashboard, "admin_token": dashboard.admin_token}),
    )
    return with_request_ids(guarded(app, port, names))


def build_dashboard(
    board: Board, events: Events, admin_token: str, base_url: str, stopping: anyio.Event, records: RequestLog
) -> Dashboard:
    """The dashboard's parts; its hub listens to the events from here on."""
    events.listen(board.hub.event)
    return Dashboard(
        board=board,
        sessions=Sessions(board.clock),
        signins=SignIns(board.clock),
        events=events,
        admin_token=admin_token,
        base_url=base_url,
        stopping=stopping,
        templates=templates(),
        assets=load_assets(),
        records=records,
    )


__all__ = ["Board", "Dashboard", "build_dashboard", "create_dashboard_app"]
