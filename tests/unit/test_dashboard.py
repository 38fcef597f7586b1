"""The dashboard's parts on fakes: sign-in links and sessions on a clock the test moves; the view data
(cards, the memory picture, what a switch would do) on a real fleet, switchboard and admission with fake
engine processes in virtual time; the live stream's diffing and its bounded mark; the Requests page's
filters, cells and live table on the request log with a store in memory; the Charts page's data from the
same log and the timeline's marks."""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from capyctl.adapters.dashboard.board import PER_DEPLOYMENT, Board, Timeline
from capyctl.adapters.dashboard.charts import SERIES, WINDOW, charts, read_params
from capyctl.adapters.dashboard.live import Feed, Hub, stream
from capyctl.adapters.dashboard.requests import ROWS, Table, chosen, fields, figure, page_filter, settlement
from capyctl.adapters.dashboard.security import host_ok, served_names
from capyctl.adapters.dashboard.sessions import LINK_TTL, MAX_SESSIONS, SESSION_IDLE, Sessions, SignIns, admin_token_ok
from capyctl.adapters.dashboard.views import consequences, counted, unplaced_card
from capyctl.adapters.dashboard.web import templates
from capyctl.domain.config import Switching
from capyctl.domain.engines import EngineFamily, EngineInstall
from capyctl.domain.errors import DailyLimit, InvalidRequest
from capyctl.domain.memory import Device
from capyctl.domain.request_charts import Recent
from capyctl.domain.request_rows import LIMIT_MOST, RequestRow, RowFilter
from capyctl.domain.requests import RequestRecord
from capyctl.domain.scheduling import QueueLimits
from capyctl.services.admission import AdmissionService
from capyctl.services.controllers import ControllerSettings
from capyctl.services.events import Events
from capyctl.services.fleet import Fleet
from capyctl.services.keys import Keyring
from capyctl.services.request_log import RequestLog
from capyctl.services.switching import Switchboard
from tests.fakes.ports import FakeClock, FakeEngineAdapter, FakeProcessControl, FakeStore, VirtualClock, virtual_time
from tests.fakes.request_store import FakeRequestStore

GiB = 2**30
SETTINGS = ControllerSettings(startup_timeout=60, stop_grace=0.1, poll_interval=0.01, max_start_failures=3)


# --- sign-in links and sessions ------------------------------------------------------------------------
def test_a_sign_in_link_works_once_and_only_within_its_minute() -> None:
    clock = FakeClock()
    links = SignIns(clock)
    used, late, unknown = links.issue(), links.issue(), "x" * 43
    clock.now += LINK_TTL - 0.1
    assert links.redeem(used) is True
    assert links.redeem(used) is False  # once
    clock.now += 0.1
    assert links.redeem(late) is False  # 60 s after it was issued
    assert links.redeem(unknown) is False


def test_a_session_is_known_by_its_id_only_and_checks_its_csrf_token() -> None:
    clock = FakeClock()
    sessions = Sessions(clock)
    session_id, session = sessions.open("one-time link")
    assert sessions.get(session_id) is session
    assert sessions.get(session_id + "x") is None and sessions.get("") is None and sessions.get(None) is None
    assert session.csrf_ok(session.csrf)
    assert not session.csrf_ok(None) and not session.csrf_ok("") and not session.csrf_ok(session.csrf[:-1])
    assert session.label not in session_id and session.csrf != session_id
    sessions.close(session_id)
    assert sessions.get(session_id) is None


def test_a_session_ends_when_idle_and_the_least_recently_used_goes_first_when_full() -> None:
    clock = FakeClock()
    sessions = Sessions(clock)
    idle_id, _ = sessions.open("admin token")
    clock.now += SESSION_IDLE
    assert sessions.get(idle_id) is None
    ids = [sessions.open("admin token")[0] for _ in range(MAX_SESSIONS)]
    clock.now += 1
    for session_id in ids[1:]:
        assert sessions.get(session_id) is not None  # used: ids[0] is now the least recently used
    newest, _ = sessions.open("admin token")
    assert sessions.get(ids[0]) is None and sessions.get(newest) is not None and len(sessions) == MAX_SESSIONS


def test_only_the_admin_token_signs_in() -> None:
    assert admin_token_ok(" tok3n\n", "tok3n")
    assert not admin_token_ok("capy-abc.secret", "tok3n") and not admin_token_ok("", "tok3n")


def test_the_host_must_name_this_listener_by_address_localhost_or_its_configured_name() -> None:
    names = served_names("cap.internal")
    for host in (
        "127.0.0.1:7443",
        "localhost:7443",
        "LOCALHOST:7443",
        "[::1]:7443",
        "10.1.2.3:7443",
        "cap.internal:7443",
    ):
        assert host_ok(host, 7443, names), host
    for host in ("127.0.0.1:7444", "127.0.0.1", "evil.example:7443", "127.0.0.1.nip.io:7443", "", "localhost.:7443"):
        assert not host_ok(host, 7443, names), host
    assert served_names("0.0.0.0") == {"localhost"} and "[fd00::1]" in served_names("fd00::1")


# --- the live stream ----------------------------------------------------------------------------------
async def test_any_number_of_changes_while_a_stream_is_busy_leave_one_mark() -> None:
    hub = Hub(lambda: 5.0)
    with hub.feed() as feed:
        for _ in range(10_000):
            hub.event("a", "state_changed", {"state": "ready"})
        with anyio.fail_after(1):
            await feed.wait(60)  # the mark is there: at once
        with anyio.move_on_after(0.05) as waited:
            await feed.wait(60)  # and only one
        assert waited.cancelled_caught
    assert hub.streams == 0 and hub.since["a"] == ("ready", 5.0)


async def test_a_stream_sends_everything_first_then_only_what_changed_and_ends_with_the_session() -> None:
    snapshots = iter([{"a": 1, "b": 2}, {"a": 1, "b": 3}, {"a": 1, "b": 3, "c": 4}])
    alive = iter([True, True, True, False])
    feed = Feed()
    feed.offer()
    sent = []
    async for message in stream(
        feed, lambda: next(snapshots), lambda name, now: f"{name}={now[name]}", lambda: next(alive), anyio.Event()
    ):
        feed.offer()  # as if every event came at once
        sent.append((message.event, message.data))
    assert sent == [(None, None), ("a", "a=1"), ("b", "b=2"), ("b", "b=3"), ("c", "c=4"), ("signed-out", "signed out")]


async def test_a_stream_awaits_a_snapshot_read_off_the_loop() -> None:
    reads = iter([{"requests": ("r1",)}, {"requests": ("r1",)}, {"requests": ("r2", "r1")}])
    alive = iter([True, True, True, False])

    async def snapshot() -> dict[str, Any]:
        await anyio.sleep(0)
        return next(reads)

    feed = Feed()
    sent = []
    async for message in stream(
        feed, snapshot, lambda name, now: ",".join(now[name]), lambda: next(alive), anyio.Event()
    ):
        feed.offer()
        sent.append((message.event, message.data))
    assert sent == [(None, None), ("requests", "r1"), ("requests", "r2,r1"), ("signed-out", "signed out")]


# --- the Requests page ----------------------------------------------------------------------------------
def test_the_requests_form_drops_blank_fields_shows_200_rows_and_keeps_the_records_strictness() -> None:
    blank = {"deployment": "", "key": " ", "status": "", "code": "", "since": ""}  # a form sent as it is
    assert page_filter(blank, 1000.0) == RowFilter(limit=ROWS) and chosen(blank) == {}
    given = {"deployment": "alpha", "key": "team", "status": "404", "code": "model_not_found", "since": "10m"}
    assert page_filter(given, 1000.0) == RowFilter(
        deployment="alpha", key="team", status=404, code="model_not_found", since=400.0, limit=ROWS
    )
    assert chosen({**given, "key": ""}) == {k: v for k, v in given.items() if k != "key"}
    assert page_filter({"limit": "5"}, 0).limit == 5
    for params, name in [
        ({"status": "abc"}, "status"),
        ({"status": "700"}, "status"),
        ({"since": "soon"}, "since"),
        ({"limit": str(LIMIT_MOST + 1)}, "limit"),
        ({"limit": "0"}, "limit"),
        ({"colour": "red"}, "colour"),
        ({"colour": ""}, "colour"),
    ]:
        with pytest.raises(InvalidRequest) as refused:
            page_filter(params, 1000.0)
        assert refused.value.extra["param"] == name and name in refused.value.message, params


def test_a_figure_nobody_measured_is_a_dash_never_0() -> None:
    assert [figure(None), figure(0), figure(0.0), figure(12.345), figure(37), figure(1.25, 2)] == [
        "–",
        "0",
        "0.0",
        "12.3",
        "37",
        "1.25",
    ]
    cut = RequestRow(id="R1", at=1.0, api="chat", code="client_gone", cause="client_gone", settlement="engine_idle")
    assert settlement(cut) == "engine_idle (unsettled)"
    assert settlement(RequestRow(id="R1", at=1.0, api="chat", code="ok")) == "–"
    done = msgspec.structs.replace(cut, settled_s=2.5)
    assert settlement(done) == "engine_idle after 2.5 s"
    shown = dict(fields(done))
    assert list(shown) == list(RequestRow.__struct_fields__)  # every field, in the record's order
    assert (shown["id"], shown["stream"], shown["ttft_ms"], shown["settled_s"], shown["at"]) == (
        "R1",
        "no",
        "–",
        "2.5",
        "1.000 (1970-01-01 00:00:01 UTC)",
    )


# --- the Charts page -------------------------------------------------------------------------------------
def test_the_charts_query_takes_a_known_window_and_a_deployment_and_names_a_bad_parameter() -> None:
    assert read_params({}) == (WINDOW, None) == read_params({"window": " ", "deployment": ""})
    assert read_params({"window": "15m", "deployment": "alpha"}) == ("15m", "alpha")
    assert read_params({"window": "24h"}) == ("24h", None)
    for params, name in [({"window": "2h"}, "window"), ({"window": "15M"}, "window"), ({"colour": "red"}, "colour")]:
        with pytest.raises(InvalidRequest) as refused:
            read_params(params)
        assert refused.value.extra["param"] == name and name in refused.value.message, params


async def test_charts_show_each_deployments_figures_per_bucket_with_its_parks_wakes_and_switches_marked(
    tmp_path: Path,
) -> None:
    clock = FakeClock()
    records = RequestLog(FakeRequestStore(), clock)
    now = clock.wall()
    records.add(
        RequestRow(
            id="A1",
            at=now,
            api="chat",
            code="ok",
            deployment="alpha",
            ttft_ms=40.0,
            decode_tokens_per_second=90.0,
            queue_wait_ms=5.0,
        )
    )
    records.add(RequestRow(id="A2", at=now, api="chat", code="engine_error", deployment="alpha"))
    await records.flush()
    store = FakeStore()
    for at, kind in [
        (now - 120, "parked"),
        (now - 60, "woken"),
        (now - 30, "switch_completed"),
        (now - 20, "state_changed"),
        (now - 7200, "parked"),
    ]:  # not a mark; before the window
        store.add_event(at, "alpha", kind, {"seconds": 1.5})
    timeline = Timeline(store, tmp_path)
    await timeline.ensure_seeded()
    shown = charts("15m", await records.chart("15m"), ["beta", "alpha"], timeline.marks, now)
    assert (shown.window, shown.bucket_seconds, len(shown.times)) == ("15m", 30, 30)
    assert shown.start == shown.times[0] and shown.end == shown.times[-1] + 30 and shown.start <= now < shown.end
    alpha, beta = shown.deployments  # by name; beta has no records: empty buckets, not a missing chart
    assert (alpha.name, alpha.requests, alpha.errors, beta.name, beta.requests) == ("alpha", 2, 1, "beta", 0)
    assert set(alpha.series) == set(SERIES) and all(len(v) == 30 for v in alpha.series.values())
    assert alpha.series["requests_per_second"][-1] == round(2 / 30, 4) and alpha.series["errors"][-1] == 1
    assert alpha.series["ttft_p50_ms"][-1] == 40.0 and alpha.series["queue_wait_p95_ms"][-1] == 5.0
    assert alpha.series["ttft_p50_ms"][:-1] == [None] * 29  # nobody measured one there: no figure, never 0
    assert beta.series["requests_per_second"] == [0.0] * 30 and beta.series["ttft_p95_ms"] == [None] * 30
    assert [(m.kind, m.event, m.at) for m in alpha.marks] == [
        ("park", "parked", now - 120),
        ("wake", "woken", now - 60),
        ("switch", "switch_completed", now - 30),
    ]
    assert alpha.marks[0].detail == "seconds=1.5" and beta.marks == []
    encoded = msgspec.json.decode(msgspec.json.encode(shown))  # as GET /ui/charts/data answers it
    assert encoded["deployments"][0]["series"]["requests_per_second"][-1] > 0
    only = charts("1h", await records.chart("1h", "beta"), ["beta"], timeline.marks, now)
    assert [d.name for d in only.deployments] == ["beta"] and len(only.times) == 60


async def test_the_timeline_keeps_the_marks_apart_from_busier_events(tmp_path: Path) -> None:
    store = FakeStore()
    store.add_event(1000.0, "alpha", "parked", {})
    for i in range(PER_DEPLOYMENT + 10):
        store.add_event(1001.0 + i, "alpha", "request_cut", {})
    timeline = Timeline(store, tmp_path)
    await timeline.ensure_seeded()
    assert "parked" not in [e.kind for e in timeline.by_deployment["alpha"]]  # pushed off the events page
    store.add_event(2000.0, "alpha", "woken", {})
    timeline.refresh()
    assert [(m.event, m.kind) for m in timeline.marks["alpha"]] == [("parked", "park"), ("woken", "wake")]


class CountingStore(FakeRequestStore):
    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def list_requests(self, where: RowFilter) -> list[RequestRow]:
        self.reads += 1
        return super().list_requests(where)


async def test_a_live_requests_table_reads_the_store_again_only_after_new_rows_were_stored() -> None:
    store = CountingStore()
    clock = FakeClock()
    records = RequestLog(store, clock)
    now = clock.wall()  # rows of now: older ones would be pruned by the records' retention
    records.add(RequestRow(id="A1", at=now, api="chat", code="ok", deployment="alpha", ttft_ms=12.5))
    records.add(RequestRow(id="B1", at=now + 1, api="chat", code="ok", deployment="beta"))
    table = Table(records, RowFilter(deployment="alpha", limit=ROWS))
    assert [r.id for r in await table.rows()] == ["A1"] and store.reads == 1
    for _ in range(5):
        assert [r.id for r in await table.rows()] == ["A1"]
    assert store.reads == 1  # nothing new was stored: no read
    records.add(RequestRow(id="A2", at=now + 2, api="chat", code="ok", deployment="alpha"))
    assert [r.id for r in await table.rows()] == ["A1"] and store.reads == 1  # buffered, not stored yet
    await records.flush()
    assert [r.id for r in await table.rows()] == ["A2", "A1"] and store.reads == 2
    records.settle("A1", "engine_idle", 1.5)  # a settlement changes a row too
    await records.flush()
    assert [r.settled_s for r in await table.rows()] == [None, 1.5]


# --- view data on a real fleet with fake engines, in virtual time -----------------------------------------------
class ParkingAdapter(FakeEngineAdapter):
    family = "vllm"

    def probe(self, path: Path) -> tuple[str, str]:
        return "0.32.0", "vllm 0.32.0"


class World:
    """A 2.5 GiB device; deployments of 1 GiB awake, 0.25 GiB parked (host_backed, a vLLM family fake)."""

    def __init__(self, tmp_path: Path) -> None:
        self.store = FakeStore()
        self.store.put_engine(
            EngineInstall(name="e", family=EngineFamily.VLLM, path="/venv", version="0.32.0", version_text="")
        )
        self.model = tmp_path / "model"
        self.model.mkdir()
        self.clock = VirtualClock()
        self.events = Events(self.store, self.clock)
        self.admission = AdmissionService(QueueLimits(), self.clock, 1800.0)
        self.room = Switchboard(
            [Device(name="gpu0", capacity=int(2.5 * GiB))],
            Switching(admission_window=0.5, drain_timeout=30),
            self.admission,
            self.clock,
            self.events,
        )
        ports = itertools.count(7000)
        self.fleet = Fleet(
            self.store,
            {"vllm": ParkingAdapter()},
            FakeProcessControl(),
            self.clock,  # type: ignore[dict-item]
            self.events,
            lambda: next(ports),
            tmp_path / "logs",
            SETTINGS,
            self.room,
        )
        self.room.bind(self.fleet.controllers)
        self.keys = Keyring(self.store, self.clock, self.events)
        self.hub = Hub(self.clock.wall)
        self.events.listen(self.hub.event)
        self.board = Board(self.fleet, self.admission, self.keys, self.store, self.clock, self.hub, tmp_path / "logs")
        self.ids = itertools.count()

    async def deploy(self, name: str, memory: str = "1GiB") -> None:
        await self.fleet.apply(
            {
                "name": name,
                "engine": "e",
                "model": str(self.model),
                "residency": "host_backed",
                "resources": {"memory": memory, "parked_memory": "256MiB"},
            },
            activate=False,
        )

    async def request(self, name: str) -> None:
        controller = self.fleet.instances(name)[0]
        record = RequestRecord(id=f"{name}-{next(self.ids)}", deployment=name, stream=False)
        async with self.admission.admit(controller, record, None):
            await controller.route(1800)
            await anyio.sleep(0.1)

    def card(self, name: str) -> Any:
        return self.board.snapshot("fleet")[f"card-{name}"]

    def memory(self) -> Any:
        (bar,) = self.board.snapshot("memory")["memory"]
        return bar


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return virtual_time()


@pytest.fixture
async def world(tmp_path: Path) -> AsyncIterator[World]:
    w = World(tmp_path)
    async with anyio.create_task_group() as tg:
        await tg.start(w.fleet.run)
        yield w
        tg.cancel_scope.cancel()


def allowed(card: Any) -> dict[str, bool]:
    return {a.name: a.allowed for a in card.actions}


async def test_cards_show_state_since_when_queues_and_only_the_legal_actions(world: World) -> None:
    await world.deploy("a")
    await world.deploy("b")
    assert allowed(world.card("a")) == {"start": True, "stop": True, "park": False}
    await world.request("a")
    a = world.card("a")
    assert (a.state, a.engine, a.engine_version, a.in_flight, a.waiting) == ("ready", "vllm", "0.32.0", 0, 0)
    assert a.since is not None and a.since <= world.clock.wall() and a.pid is not None
    assert allowed(a) == {"start": False, "stop": True, "park": True}
    await world.fleet.stop("b")
    b = world.card("b")
    assert b.operator_stopped and allowed(b) == {"start": True, "stop": False, "park": False}
    assert b.action("park").why_not == "an operator stopped it"


async def test_a_card_shows_its_own_deployments_last_five_minutes_from_the_records(world: World) -> None:
    await world.deploy("a")
    await world.deploy("b")
    assert world.card("a").recent is None  # no request: nothing made up
    world.board.recent = lambda: {"a": Recent(3, 120.0, 41.5)}
    assert world.card("a").recent == Recent(3, 120.0, 41.5) and world.card("b").recent is None


async def test_a_start_under_way_shows_its_elapsed_time_against_the_measured_usual(world: World) -> None:
    await world.deploy("a")
    await world.request("a")  # the first start is measured
    measured = world.fleet.get("a").status.cold_starts
    assert len(measured) == 1
    await world.fleet.stop("a")
    adapter = world.fleet.get("a").members[0].adapter
    adapter.healthy = False  # type: ignore[attr-defined]  # the next start does not get ready
    await world.fleet.start("a")
    await anyio.sleep(3)
    progress = world.card("a").progress
    assert progress is not None and (progress.what, progress.usual) == ("start", round(measured[0], 1))
    assert 2.9 <= progress.elapsed <= 3.1
    adapter.healthy = True  # type: ignore[attr-defined]


async def test_the_memory_picture_and_what_a_switch_would_do_come_from_the_domains_plan(world: World) -> None:
    for name in ("a", "b", "c"):
        await world.deploy(name)
    await world.deploy("huge", memory="3GiB")
    await world.request("a")
    await anyio.sleep(5)
    await world.request("b")  # a is now the least recently used
    bar = world.memory()
    assert [(s.deployment, s.kind, s.size) for s in bar.segments] == [("a", "awake", GiB), ("b", "awake", GiB)]
    assert bar.free == GiB // 2 and [s.start_pct for s in bar.segments] == [0.0, 40.0]
    outlooks = {o.deployment: o for o in bar.outlooks}
    assert outlooks["c"].verdict == "switch"
    assert outlooks["c"].victims == (("a", "park", GiB - GiB // 4),)  # parking a leaves room: no need to stop it
    assert outlooks["huge"].verdict == "never"
    lines = consequences(
        "park", world.fleet.get("a").members[0], world.admission, world.fleet.room, world.fleet.controllers()
    )
    assert "It frees 0.75 GiB on gpu0." in lines
    assert world.memory().outlooks is bar.outlooks  # nothing changed: the plans are not made again
    await anyio.sleep(5)
    await world.request("a")  # now b is the least recently used: the plan changes, and the page with it
    assert {o.deployment: o for o in world.memory().outlooks}["c"].victims == (("b", "park", GiB - GiB // 4),)

    await world.fleet.park("a")
    bar = world.memory()
    assert [(s.deployment, s.kind, s.size) for s in bar.segments] == [("a", "parked", GiB // 4), ("b", "awake", GiB)]
    assert {o.deployment: o.verdict for o in bar.outlooks} == {"c": "fits", "huge": "never"}
    assert allowed(world.card("a")) == {"start": True, "stop": True, "park": False}


async def test_keys_show_calls_limits_and_refusals_never_a_secret(world: World) -> None:
    key, secret = world.keys.create("team", daily_limit=1)
    world.keys.let_in(key, "r1")
    world.keys.admitted("r1")
    for request in ("r2", "r3"):
        with pytest.raises(DailyLimit):
            world.keys.let_in(key, request)
    (row,) = [r for r in world.board.key_rows() if r.name == "team"]
    assert (row.used_today, row.daily_limit, row.refused_today, row.under_way) == (1, 1, 2, 0)
    assert [e["detail"] for e in world.store.events if e["kind"] == "daily_limit_reached"] == [
        {"key": "team", "daily_limit": 1}
    ]  # the first refusal of the day only
    assert secret not in repr(world.board.snapshot("keys")) and key.digest not in repr(world.board.snapshot("keys"))


async def test_the_timeline_groups_events_by_deployment_with_the_launch_log_in_effect(
    world: World, tmp_path: Path
) -> None:
    logs = tmp_path / "logs" / "a"
    logs.mkdir(parents=True)
    (logs / "1000000000-1.log").write_text("first launch\n")
    (logs / "1000002000-2.log").write_text("second launch\n")
    world.store.events.clear()
    for at, deployment, kind in [
        (999_999.0, "a", "deployment_created"),
        (1_000_001.0, "a", "state_changed"),
        (1_000_003.0, "a", "engine_crashed"),
        (1_000_001.5, None, "key_created"),
        (1_000_003.5, "a", "router_selection"),
    ]:  # per request: left out
        world.store.add_event(at, deployment, kind, {"n": 1})
    timeline = Timeline(world.store, tmp_path / "logs")
    await timeline.ensure_seeded()
    (a, a_events), (server, server_events) = timeline.view()
    assert (a, server) == ("a", None)
    assert [(e.kind, e.log) for e in a_events] == [
        ("engine_crashed", "1000002000-2.log"),
        ("state_changed", "1000000000-1.log"),
        ("deployment_created", None),
    ]
    assert [e.kind for e in server_events] == ["key_created"] and a_events[0].detail == "n=1"
    world.store.add_event(1_000_004.0, "a", "operator_start", {})
    timeline.refresh()
    assert timeline.view("a")[0][1][0].kind == "operator_start"


async def test_unsettled_cut_requests_are_marked_and_change_what_a_switch_would_do(world: World) -> None:
    for name in ("a", "b", "c"):
        await world.deploy(name)
    await world.request("a")
    await anyio.sleep(5)
    await world.request("b")
    world.fleet.get("a").members[0].cut(RequestRecord(id="cut-1", deployment="a", stream=True))  # cut before any output
    bar = world.memory()
    assert {s.deployment: s.unsettled for s in bar.segments} == {"a": 1, "b": 0}
    (c,) = bar.outlooks
    assert c.victims == (("a", "stop", GiB),)  # it may still run on the engine: only a stop settles it


async def test_a_park_of_any_residency_leaves_its_mark_on_the_charts_and_a_plain_stop_none(
    world: World, tmp_path: Path
) -> None:
    await world.fleet.apply(
        {
            "name": "r",
            "engine": "e",
            "model": str(world.model),
            "residency": "restart_only",
            "resources": {"memory": "1GiB"},
        },
        activate=False,
    )
    await world.deploy("h")
    for name in ("r", "h"):
        await world.request(name)
        await world.fleet.park(name)  # restart_only: its park stops the engine; host_backed: it sleeps
    assert (world.card("r").state, world.card("h").state) == ("stopped", "parked")
    await world.request("r")
    await world.fleet.stop("r")  # an operator's stop is no park
    timeline = Timeline(world.store, tmp_path / "logs")
    await timeline.ensure_seeded()
    assert [(m.kind, m.event) for m in timeline.marks["r"]] == [("park", "gave_way")]
    assert timeline.marks["r"][0].detail == "stopped after operator_park"
    assert [(m.kind, m.event) for m in timeline.marks["h"]] == [("park", "parked")]
    await world.board.timeline.ensure_seeded()  # as the Charts page's live stream does first
    fragments = world.board.snapshot("charts", None, "15m")  # what it compares and sends
    assert set(fragments) == {"marks-r", "marks-h"} and [m.kind for m in fragments["marks-r"]] == ["park"]
    assert world.board.snapshot("charts", "h", "15m") == {"marks-h": tuple(timeline.marks["h"])}


async def test_counts_are_written_in_the_singular_for_one(world: World) -> None:
    assert [counted(0, "request"), counted(1, "request"), counted(2, "waiting request")] == [
        "0 requests",
        "1 request",
        "2 waiting requests",
    ]
    await world.deploy("a")
    await world.request("a")
    lines = consequences(
        "stop", world.fleet.get("a").members[0], world.admission, world.fleet.room, world.fleet.controllers()
    )
    assert "0 requests in flight are cut; 0 waiting requests are refused (deployment_stopped)." in lines
    assert not [line for line in lines if "(s)" in line]
    assert "1 cut request still counted" in templates().get_template("_memory.html").render(
        bars=[
            msgspec.structs.replace(
                world.memory(), segments=tuple(msgspec.structs.replace(s, unsettled=1) for s in world.memory().segments)
            )
        ]
    )


async def test_a_card_names_the_host_its_engine_runs_on_and_nothing_on_this_machine(world: World) -> None:
    await world.deploy("a")
    here = world.card("a")
    assert here.host is None
    env = templates()
    assert "<dt>Host</dt>" not in env.get_template("_card.html").render(c=here)
    there = env.get_template("_card.html").render(c=msgspec.structs.replace(here, host="gpu-a"))
    assert '<dt>Host</dt><dd class="host"><a href="/ui/hosts#host-gpu-a">gpu-a</a></dd>' in there


async def test_a_card_says_why_instances_have_no_place_and_one_with_none_placed_can_only_be_started(
    world: World,
) -> None:
    document = {"name": "pair", "engine": "e", "model": str(world.model), "instances": 2}
    await world.fleet.apply({**document, "placement": {"max_per_host": 1}}, activate=False)
    shown = world.card("pair")
    assert shown.unplaced == ("instance 1: no place: this machine: runs 1 instance already (placement.max_per_host)",)
    html = templates().get_template("_card.html").render(c=shown)
    assert "<dt>Not placed</dt>" in html and "placement.max_per_host" in html
    none = unplaced_card(world.fleet.get("pair"), world.admission)
    assert (none.name, none.state, none.pid) == ("pair", "unplaced", None)
    assert allowed(none) == {"start": True, "stop": False, "park": False}
