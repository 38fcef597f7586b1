"""The dashboard's reads: each page's data, from the same services the management API reads.

``Board.snapshot(page)`` gives a page's fragments by name (what the live
stream compares and sends); the page itself renders the same fragments.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from capyctl.adapters.dashboard.charts import WINDOW, marks_in, window_edges
from capyctl.adapters.dashboard.hosts import HostRow, host_rows
from capyctl.adapters.dashboard.live import Hub
from capyctl.adapters.dashboard.marks import Mark, mark_of, words
from capyctl.adapters.dashboard.views import Card, Outlooks, bars, card, unplaced_card
from capyctl.domain.deployments import NAME_PATTERN, InstanceState
from capyctl.domain.ports import Clock, Store
from capyctl.domain.request_charts import Recent
from capyctl.services.admission import AdmissionService
from capyctl.services.fleet import Fleet
from capyctl.services.keys import Keyring

if TYPE_CHECKING:
    from capyctl.adapters.http.management import Hosts

PAGES = ("fleet", "memory", "keys", "events", "requests", "charts", "hosts")  # requests: read by app.live
LOG_NAME = re.compile(r"(\d{1,16})-(\d{1,9})\.log")  # <wall ms>-<launch>.log, as local_engines names them
PER_DEPLOYMENT = 50  # events kept per deployment on the timeline
PER_MARKS = 500  # parks, wakes, switches and stops kept per deployment for the charts' time axis
PER_REQUEST = frozenset({"router_selection"})  # one per request: the requests' own records show them, not here
_SCAN = 1000  # events read from the store at a time


class KeyRow(msgspec.Struct, frozen=True):
    name: str
    used_today: int
    daily_limit: int | None
    under_way: int
    refused_today: int
    last_used: float | None
    models: tuple[str, ...] | None


class Entry(msgspec.Struct, frozen=True):
    id: int
    at: float
    kind: str
    detail: str  # its fields, as "key=value" words
    log: str | None  # the launch's log file in effect then (its name under logs/<deployment>/)


class Timeline:
    """The newest events per deployment (None: the server's own), read from the store by ID as they come."""

    def __init__(self, store: Store, log_root: Path) -> None:
        self._store = store
        self._log_root = log_root
        self._after = 0
        self._seeded = False
        self._seeding = anyio.Lock()
        self.by_deployment: dict[str | None, deque[Entry]] = {}
        self.marks: dict[str, deque[Mark]] = {}  # the charts' marks, kept apart so busier kinds never push them out

    async def ensure_seeded(self) -> None:
        """The first read goes through the whole stored table, off the event loop (it may hold 100,000)."""
        async with self._seeding:
            if not self._seeded:
                await anyio.to_thread.run_sync(self._read, 100)
                self._seeded = True

    def refresh(self) -> None:
        """What was stored since the last read (on the loop: a few rows, by the primary key)."""
        if self._seeded:
            self._read(10)

    def _read(self, rounds: int) -> None:
        logs: dict[str, list[tuple[int, str]]] = {}
        for _ in range(rounds):
            rows = self._store.list_events(None, self._after, _SCAN)
            for row in rows:
                self._add(row, logs)
            if len(rows) < _SCAN:
                return
            self._after = rows[-1]["id"]

    def _add(self, row: dict[str, Any], logs: dict[str, list[tuple[int, str]]]) -> None:
        self._after = max(self._after, row["id"])
        if row["kind"] in PER_REQUEST:
            return
        name = row["deployment"]
        if (mark := mark_of(name, row["kind"], row["detail"], row["at"])) is not None:
            self.marks.setdefault(name, deque(maxlen=PER_MARKS)).append(mark)
        detail = words(row["detail"])
        log = None
        if name is not None:
            if name not in logs:
                logs[name] = self._launch_logs(name)
            at_ms = int(row["at"] * 1000)
            began = [file for start, file in logs[name] if start <= at_ms]
            log = began[-1] if began else None
        entry = Entry(row["id"], row["at"], row["kind"], detail, log)
        self.by_deployment.setdefault(name, deque(maxlen=PER_DEPLOYMENT)).append(entry)

    def _launch_logs(self, deployment: str) -> list[tuple[int, str]]:
        """The deployment's launch logs, oldest first, by the wall time in their names."""
        if not NAME_PATTERN.fullmatch(deployment):
            return []
        try:
            names = [p.name for p in (self._log_root / deployment).iterdir()]
        except OSError:
            return []
        found = [(int(m.group(1)), n) for n in names if (m := LOG_NAME.fullmatch(n))]
        return sorted(found)

    def view(self, deployment: str | None = None) -> tuple[tuple[str | None, tuple[Entry, ...]], ...]:
        """Deployments by name (the server's own events last), each with its events newest first."""
        names = sorted((n for n in self.by_deployment if n is not None), key=str)
        if deployment is not None:
            names = [n for n in names if n == deployment]
        groups: list[tuple[str | None, tuple[Entry, ...]]] = [
            (n, tuple(reversed(self.by_deployment[n]))) for n in names
        ]
        if deployment is None and None in self.by_deployment:
            groups.append((None, tuple(reversed(self.by_deployment[None]))))
        return tuple(groups)


class Board:
    def __init__(
        self,
        fleet: Fleet,
        admission: AdmissionService,
        keys: Keyring,
        store: Store,
        clock: Clock,
        hub: Hub,
        log_root: Path,
        recent: Callable[[], Mapping[str, Recent]] = dict,
        hosts: Hosts | None = None,
        host_views: Callable[[], list[dict[str, Any]]] = list,
    ) -> None:
        self.fleet = fleet
        self.hosts = hosts  # None: this CapyCTL runs standalone (no `capyctl start server`)
        self.host_views = host_views  # each host as GET /hosts answers it
        self.admission = admission
        self.keys = keys
        self.clock = clock
        self.hub = hub
        self.log_root = log_root
        self.recent = recent  # per deployment, its answers of the last 5 minutes (the request records')
        self.timeline = Timeline(store, log_root)
        self._timeline_version = -1
        self._outlooks: Outlooks = {}  # the Memory page's last plans, kept while the residents stay the same

    def since(self, name: str, state: str, ready_at: float | None, started_at: float | None) -> float | None:
        """When the deployment's current state began: from its last state change seen here, else what its
        status tells (ready since, starting since), else unknown."""
        seen = self.hub.since.get(name)
        if seen is not None and seen[0] == state:
            return seen[1]
        if state == InstanceState.READY:
            return ready_at
        if state == InstanceState.STARTING:
            return started_at
        return None

    def cards(self) -> list[Card]:
        out, now, recent = [], self.clock.wall(), self.recent()
        for found in self.fleet.deployments():
            c = found.lead
            if c is None:
                out.append(unplaced_card(found, self.admission))
                continue
            status = c.status
            since = self.since(c.name, str(status.state), status.ready_at, status.started_at)
            out.append(card(c, self.admission, since, now, recent.get(c.name), found.members, found.unplaced))
        return out

    def key_rows(self) -> tuple[KeyRow, ...]:
        return tuple(
            KeyRow(
                key.name,
                usage.used,
                key.daily_limit,
                usage.pending,
                usage.refused,
                usage.last_used,
                tuple(key.models) if key.models is not None else None,
            )
            for key, usage in self.keys.with_usage()
        )

    def host_rows(self) -> tuple[HostRow, ...] | None:
        """Each host as ``GET /hosts`` shows it; None on a CapyCTL that runs standalone."""
        if self.hosts is None:
            return None
        return host_rows(self.host_views())

    def chart_marks(self, deployment: str | None, window: str) -> dict[str, tuple[Mark, ...]]:
        """Each deployment's marks in ``window`` as it stands now, by its fragment's name."""
        start, end = window_edges(window, self.clock.wall())
        names = [n for n in self.fleet.names() if deployment in (None, n)]
        return {f"marks-{n}": marks_in(self.timeline.marks.get(n, ()), start, end) for n in names}

    def snapshot(self, page: str, deployment: str | None = None, window: str = WINDOW) -> dict[str, Any]:
        """A page's fragments by name, each with the data it shows."""
        if page == "fleet":
            cards = self.cards()
            return {"cards": tuple(c.name for c in cards), **{f"card-{c.name}": c for c in cards}}
        if page == "memory":
            return {"memory": tuple(bars(self.fleet.room, self.fleet.controllers(), self._outlooks))}
        if page == "keys":
            return {"keys": self.key_rows()}
        if page == "hosts":
            return {"hosts": self.host_rows()}
        if self._timeline_version != self.hub.version:  # events and marks change only with an event
            self._timeline_version = self.hub.version
            self.timeline.refresh()
        if page == "charts":
            return self.chart_marks(deployment, window)
        return {"events": self.timeline.view(deployment)}
