"""The dashboard's Hosts page on fakes: a real host registry (its links told by hand) read through the one view
``GET /hosts`` answers, in virtual time; the rows, the page's fragment and its live stream as a host goes
quiet; what a revoke or an invitation will do; the marks the charts draw for parks and stops of any
residency; and the JSON envelopes of the dashboard's own refusals."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from capyctl.adapters.dashboard.board import Board
from capyctl.adapters.dashboard.hosts import (
    DeviceRow,
    HostRow,
    drain_lines,
    host_row,
    invitation,
    invite_lines,
    revoke_lines,
)
from capyctl.adapters.dashboard.live import Feed, stream
from capyctl.adapters.dashboard.marks import Mark, mark_of
from capyctl.adapters.dashboard.web import (
    CsrfRefused,
    NotNow,
    SignInNeeded,
    SignInRefused,
    TooManyStreams,
    dashboard_envelope,
    templates,
)
from capyctl.adapters.http.management import Hosts
from capyctl.adapters.http.views import host_view
from capyctl.domain.errors import InvalidRequest, ModelNotFound
from capyctl.domain.hosts import LinkTimings
from capyctl.domain.link import DeviceReport, Hello, Inventory
from capyctl.services.server_hosts import HostRegistry
from tests.fakes.ports import virtual_time
from tests.unit.test_dashboard import World

GiB = 2**30


def http_views() -> tuple[Callable[..., Any], Any]:
    """``host_view`` (GET /hosts's one view of a host) and the management API's ``Hosts``."""
    return host_view, Hosts


class HostWorld(World):
    """The dashboard's world with a host registry (suspended after 2 s of silence, lost after 4 s) and the
    invitations it was asked for."""

    def __init__(self, tmp_path: Path) -> None:
        super().__init__(tmp_path)
        self.registry = HostRegistry(self.store, self.clock, self.events, LinkTimings(suspend_after=2, lost_after=4))
        self.invited: list[tuple[str, float, str | None]] = []
        host_view, hosts = http_views()

        def invite(name: str, ttl: float, server: str | None) -> dict[str, Any]:
            self.invited.append((name, ttl, server))
            return {"host": name, "secret": "s3cret"}

        self.board = Board(
            self.fleet,
            self.admission,
            self.keys,
            self.store,
            self.clock,
            self.hub,
            tmp_path / "logs",
            hosts=hosts(self.registry, invite),
            host_views=lambda: [host_view(v, self.fleet) for v in self.registry.views()],
        )

    def link(self, name: str, address: str) -> int:
        """Host ``name`` joined and linked, its inventory told: a 10 GiB gpu0."""
        self.registry.joined(name, f"fp-{name}")
        session, _ = self.registry.connected(
            name, address, Hello(host=name, version="9.9.9", protocol=1), close=_closed
        )
        self.registry.heard(name, session, Inventory(devices=[DeviceReport(name="gpu0", capacity=10 * GiB, reserve=0)]))
        return session

    def rows(self) -> tuple[HostRow, ...]:
        rows = self.board.snapshot("hosts")["hosts"]
        assert rows is not None
        return tuple(rows)


async def _closed(why: str) -> None:
    pass


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return virtual_time()


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[HostWorld]:
    w = HostWorld(tmp_path)
    async with anyio.create_task_group() as tg:
        await tg.start(w.fleet.run)
        yield w
        tg.cancel_scope.cancel()


def render_hosts(hosts: Any) -> str:
    return templates().get_template("_hosts.html").render(hosts=hosts)


# --- the Hosts page ------------------------------------------------------------------------------------
async def test_a_host_is_shown_as_get_hosts_shows_it_with_its_devices_charged(world: HostWorld) -> None:
    world.link("gpu-a", "10.0.0.2")
    (row,) = world.rows()
    assert (row.name, row.state, row.address, row.version, row.age) == (
        "gpu-a",
        "online",
        "10.0.0.2",
        "9.9.9",
        "0 s ago",
    )
    assert row.devices == (DeviceRow("gpu0", 0, 10 * GiB, 0),) and row.deployments == () and not row.revoked
    assert row.heard == world.clock.wall()
    text = render_hosts(world.rows())
    assert 'class="card-body state-online"' in text and "gpu0 0.00 GiB of 10.00 GiB" in text
    assert 'href="/ui/hosts/gpu-a/revoke"' in text


async def test_a_silent_host_turns_suspended_on_the_live_page_and_its_heartbeat_ages(world: HostWorld) -> None:
    world.link("gpu-a", "10.0.0.2")
    alive = True
    sent: list[str] = []

    async def watch() -> None:
        feed = Feed()
        render: Callable[[str, dict[str, Any]], str] = lambda name, now: render_hosts(now[name])  # noqa: E731
        async for message in stream(feed, lambda: world.board.snapshot("hosts"), render, lambda: alive, anyio.Event()):
            if message.event == "hosts":
                sent.append(str(message.data))

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        await anyio.sleep(3)  # nothing heard from gpu-a for 3 s: past suspend_after
        alive = False
    assert 'data-state="online"' in sent[0] and "0 s ago" in sent[0]
    assert any("1 s ago" in text and 'data-state="online"' in text for text in sent)  # it ages, live
    assert any('data-state="suspended"' in text and "2 s ago" in text for text in sent)  # sent when it went quiet
    assert 'data-state="suspended"' in sent[-1]
    assert world.rows()[0].state == "suspended"


async def test_a_revoked_host_has_no_revoke_button_and_a_standalone_capyctl_says_hosts_need_a_server(
    world: HostWorld,
) -> None:
    world.link("gpu-a", "10.0.0.2")
    await world.registry.revoke("gpu-a")
    (row,) = world.rows()
    assert row.state == "revoked" and row.revoked
    text = render_hosts(world.rows())
    assert 'href="/ui/hosts/gpu-a/revoke"' not in text and 'disabled title="it is revoked already"' in text
    standalone = Board(world.fleet, world.admission, world.keys, world.store, world.clock, world.hub, Path("logs"))
    assert standalone.snapshot("hosts") == {"hosts": None}
    assert "capyctl start server" in render_hosts(None)


def test_any_state_a_host_may_have_gets_a_class_of_its_own() -> None:
    rows = [
        host_row({"name": f"h{i}", "state": state, "silent_s": None})
        for i, state in enumerate(["disconnected", "joined", "quarantined"])
    ]
    text = render_hosts(rows)
    for state in ("disconnected", "joined", "quarantined"):
        assert f'class="card-body state-{state}" data-state="{state}"' in text
        assert f'<span class="state">{state}</span>' in text
    assert "never since the server started" in text


def test_a_hosts_row_takes_the_views_figures_and_lists_recent_exits_newest_first() -> None:
    view = {
        "name": "gpu-b",
        "state": "online",
        "address": "10.0.0.3",
        "version": "1.0",
        "last_heartbeat": 5.0,
        "silent_s": 125.0,
        "revoked_at": None,
        "instances": ["alpha"],
        "devices": [{"name": "gpu0", "capacity_bytes": 10 * GiB, "reserve_bytes": GiB, "charged_bytes": 7 * GiB}],
        "engines": [{"name": "llama", "family": "llamacpp", "version": "b5000", "path": "/x"}],
        "exits": [
            {"instance": "alpha", "pid": 11, "returncode": 1, "at": 1.0},
            {"instance": "alpha", "pid": 12, "returncode": None, "at": 2.0, "cause": "agent_stopped"},
        ],
    }
    row = host_row(view)
    assert (row.age, row.engines, row.deployments) == ("2 min ago", ("llama (llamacpp b5000)",), ("alpha",))
    assert [(e.pid, e.returncode, e.cause) for e in row.exits] == [(12, None, "agent_stopped"), (11, 1, None)]
    text = render_hosts([row])
    assert "gpu0 7.00 GiB of 10.00 GiB" in text and "status unknown, agent stopped" in text
    assert '<a href="/ui/#card-alpha">alpha</a>' in text


# --- revoke and invite -----------------------------------------------------------------------------------
def test_a_revoke_says_what_it_does_to_the_deployments_running_there() -> None:
    row = host_row({"name": "gpu-a", "state": "online", "silent_s": 1.0, "instances": ["alpha"]})
    lines = revoke_lines(row)
    assert any("refused from now on" in line for line in lines)
    assert "Requests for the 1 deployment running there now (alpha) are refused with device_offline." in lines
    idle = revoke_lines(host_row({"name": "gpu-b", "state": "lost", "silent_s": 9.0}))
    assert "No deployment runs there now." in idle and any("gpu-b is lost" in line for line in idle)


def test_a_drained_host_says_so_and_offers_undrain_and_a_drain_says_what_it_moves() -> None:
    busy = host_row({"name": "gpu-a", "state": "online", "silent_s": 1.0, "instances": ["alpha", "alpha/1"]})
    text = render_hosts([busy])
    assert 'href="/ui/hosts/gpu-a/drain" data-action="drain"' in text and "undrain" not in text
    assert '<a href="/ui/#card-alpha">alpha/1</a>' in text  # an instance links to its deployment's card
    lines = drain_lines(busy, "drain")
    assert lines[0] == "Nothing new is placed on gpu-a until it is undrained."
    assert "Each of the 2 instances running there (alpha, alpha/1) gets a replacement" in lines[1]
    drained = host_row({"name": "gpu-a", "state": "online", "silent_s": 1.0, "drain": "drained"})
    text = render_hosts([drained])
    assert 'data-drain="drained"' in text and 'href="/ui/hosts/gpu-a/undrain" data-action="undrain"' in text
    assert 'href="/ui/hosts/gpu-a/drain"' not in text
    assert "it is drained at once" in drain_lines(host_row({"name": "b", "state": "online"}), "drain")[1]
    assert drain_lines(drained, "undrain")[0].startswith("Instances may be placed on gpu-a again")


def test_an_invitation_form_is_read_strictly_and_says_what_it_will_be() -> None:
    assert invitation({"name": "gpu-c", "ttl": "", "server": ""}) == ("gpu-c", 900.0, None)
    assert invitation({"name": " gpu-c ", "ttl": "30m", "server": "10.0.0.1:7445"}) == (
        "gpu-c",
        1800.0,
        "10.0.0.1:7445",
    )
    for fields, param in [
        ({"name": "GPU_C", "ttl": "1h"}, "name"),
        ({"name": "", "ttl": "1h"}, "name"),
        ({"name": "gpu-c", "ttl": "soon"}, "ttl"),
        ({"name": "gpu-c", "ttl": "2h"}, "ttl"),
        ({"name": "gpu-c", "ttl": "0s"}, "ttl"),
    ]:
        with pytest.raises(InvalidRequest) as refused:
            invitation(fields)
        assert refused.value.extra["param"] == param, fields
    lines = invite_lines("gpu-c", 900.0, joined=False)
    assert lines[0] == "A join file for host gpu-c: it works once, for 15 min, and only under that name."
    assert not any("replaces its certificate" in line for line in lines)
    assert any("replaces its certificate" in line for line in invite_lines("gpu-a", 60.0, joined=True))


# --- the charts' marks -----------------------------------------------------------------------------------
def test_a_stop_that_made_way_is_marked_as_what_was_asked_and_says_why() -> None:
    park = mark_of("r", "gave_way", {"instance": 0, "asked": "park", "why": "operator_park"}, 3.0)
    assert park == Mark(3.0, "park", "gave_way", "stopped after operator_park")  # restart_only: its park is a stop
    stop = mark_of("v", "gave_way", {"instance": 0, "asked": "stop", "why": "a switch for t"}, 4.0)
    assert stop == Mark(4.0, "stop", "gave_way", "stopped after a switch for t")
    for kind in ("state_changed", "operator_stop", "operator_park", "idle_stop", "switch_planned"):
        assert mark_of("r", kind, {"state": "stopped"}, 5.0) is None  # only what happened draws, not what was asked


def test_a_mark_keeps_the_events_own_words() -> None:
    assert mark_of("a", "woken", {"seconds": 1.5}, 10.0) == Mark(10.0, "wake", "woken", "seconds=1.5")
    assert mark_of(None, "switch_completed", {}, 1.0) is None  # the server's own events draw nothing


# --- the dashboard's refusals as JSON -------------------------------------------------------------------------
def test_the_dashboards_own_refusals_carry_the_type_their_status_gives() -> None:
    expected = [
        (SignInNeeded("x"), 401, "invalid_request_error"),
        (SignInRefused("x"), 401, "invalid_request_error"),
        (CsrfRefused("x"), 403, "invalid_request_error"),
        (NotNow("x"), 409, "invalid_request_error"),
        (TooManyStreams("x"), 503, "service_unavailable"),
    ]
    for error, status, kind in expected:
        got_status, body = dashboard_envelope(error)
        assert (got_status, body["error"]["type"], body["error"]["code"]) == (status, kind, error.code), error
    status, body = dashboard_envelope(ModelNotFound("m", []))  # not the dashboard's own: as everywhere else
    assert (status, body["error"]["type"], body["error"]["available"]) == (404, "invalid_request_error", [])
    assert msgspec.json.decode(msgspec.json.encode(body))["error"]["message"]


async def test_a_card_shows_an_engine_held_by_its_host_and_a_hosts_doing_as_no_error() -> None:
    from capyctl.adapters.dashboard.views import card
    from capyctl.domain.errors import DeviceOffline
    from capyctl.domain.scheduling import QueueLimits
    from capyctl.services.admission import AdmissionService
    from tests.unit.test_managed import S, bound
    from tests.unit.test_managed import World as Managed

    async with bound(Managed()) as w:
        admission = AdmissionService(QueueLimits(), w.controller._clock, 1800.0)  # noqa: SLF001 - its own clock
        await w.controller.route(5)
        w.effects.unreachable = DeviceOffline("gpu-a", "lost", model="m")  # its host went silent
        shown = card(w.controller, admission, None, 0.0)
        assert shown.state == "held" and shown.held is not None and "lost" in shown.held
        w.effects.unreachable = None
        w.effects.launch_gate = back = anyio.Event()  # the next launch waits for its host, as a host's does
        w.effects.crash(1, code=0, cause="agent_stopped")  # its host's agent stopped: not the engine's error
        await w.until(lambda: "engine_ended" in w.kinds() and w.controller.status.state is not S.READY)
        shown = card(w.controller, admission, None, 0.0)
        assert shown.held is None and shown.last_error is None  # no error of its own ...
        assert shown.note is not None and "agent was stopped" in shown.note  # ... but said how it ended
        back.set()
        await w.until(lambda: w.controller.ready and w.controller.status.pid is not None)
        assert card(w.controller, admission, None, 0.0).note is None  # a later engine serves: no news
        launch = w.controller.status.pid - 100
        w.effects.crash(launch, code=-9)  # by itself, this time: an error, shown as one
        await w.until(lambda: w.controller.ready and w.controller.status.pid == 101 + launch)
        shown = card(w.controller, admission, None, 0.0)
        assert shown.note is None and shown.last_error == "engine exited with status -9 while serving"
