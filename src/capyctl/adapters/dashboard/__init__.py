"""The web dashboard, on the management listener (``/`` and ``/ui/...``): see docs/dashboard.md.

Modules: ``sessions`` (sign-in links, sessions, CSRF), ``security`` (the Host
check, the security headers, the mount beside the management API),
``views`` (each page's data as structs), ``board`` (reading them from the
services), ``requests`` (the Requests page, from the request records),
``charts`` and ``marks`` (the Charts page), ``hosts`` and ``host_pages`` (the
Hosts page and its actions), ``live`` (one event stream per open page),
``assets`` (the static files, vendored ones pinned), ``app`` (the Litestar
handlers).
It reads what the CLI reads and never sits on an inference request's path.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from capyctl.adapters.dashboard.app import build_dashboard, create_dashboard_app
from capyctl.adapters.dashboard.board import Board
from capyctl.adapters.dashboard.live import Hub
from capyctl.adapters.dashboard.security import mount, served_names
from capyctl.adapters.http.views import host_view
from capyctl.domain.ports import Clock, Store
from capyctl.services.admission import AdmissionService
from capyctl.services.events import Events
from capyctl.services.fleet import Fleet
from capyctl.services.keys import Keyring
from capyctl.services.request_log import RequestLog

if TYPE_CHECKING:
    from capyctl.adapters.http.management import Hosts


def with_dashboard(
    management: Any,
    *,
    fleet: Fleet,
    admission: AdmissionService,
    keys: Keyring,
    store: Store,
    events: Events,
    clock: Clock,
    admin_token: str,
    log_root: Path,
    listening: tuple[str, int],
    stopping: anyio.Event,
    records: RequestLog,
    hosts: Hosts | None = None,
) -> Any:
    """The management API's ASGI app with the dashboard mounted beside it on the same listener; ``hosts``
    on a server of several machines (None: standalone)."""

    def host_views() -> list[dict[str, Any]]:  # the one view of a host, GET /hosts's
        return [host_view(view, fleet) for view in hosts.registry.views()] if hosts is not None else []

    host, port = listening
    board = Board(fleet, admission, keys, store, clock, Hub(clock.wall), log_root, records.recent, hosts, host_views)
    link_host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else (f"[{host}]" if ":" in host else host)
    dashboard = build_dashboard(board, events, admin_token, f"http://{link_host}:{port}", stopping, records)
    return mount(management, create_dashboard_app(dashboard, port, served_names(host)))


__all__ = ["with_dashboard"]
