"""The web dashboard in a real headless Chromium (Debian's package, driven by Playwright; never a browser
download), against a real CapyCTL managing two stand-in vLLM 0.32.0 engines on one accounted device.

Each test records every request its pages make and checks that none left the dashboard's origin, and
that the browser reported no Content-Security-Policy violation. The screenshots in docs/images/ are
taken here.
"""

from __future__ import annotations

import re
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from playwright.sync_api import Browser, BrowserContext, Page, Playwright, expect, sync_playwright

from tests.fakes.standin_venv import make_standin_venv
from tests.integration.harness import CapyServer

pytestmark = pytest.mark.integration
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
IMAGES = Path(__file__).resolve().parents[2] / "docs" / "images"
PAGES = ["/ui/", "/ui/memory", "/ui/hosts", "/ui/requests", "/ui/charts", "/ui/keys", "/ui/events"]


class World:
    """CapyCTL with a 7 GiB device (0.5 GiB reserved) and two host_backed stand-in vLLM deployments of
    4 GiB awake, 1 GiB parked: alpha and beta cannot both be awake."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        config = tmp / "server.yaml"
        config.write_text(
            "memory:\n  devices:\n    - name: gpu0\n      capacity: 7GiB\n      reserve: 512MiB\n"
            "switching:\n  admission_window: 300ms\n"
        )
        self.server = CapyServer(tmp / "state", "--config", str(config))

    @property
    def origin(self) -> str:
        return f"http://127.0.0.1:{self.server.management_port}"

    def deploy(self, name: str) -> None:
        path = self.tmp / f"{name}.yaml"
        path.write_bytes(
            msgspec.yaml.encode(
                {
                    "name": name,
                    "engine": "vllm",
                    "model": str(self.tmp / "model"),
                    "residency": "host_backed",
                    "resources": {"memory": "4GiB", "parked_memory": "1GiB"},
                    "engine_config": {"env": {"STANDIN_LOAD_S": "0.2"}},
                }
            )
        )
        self.server.cli("deploy", "model", "--file", str(path))

    def sign_in_url(self) -> str:
        done = self.server.cli("dashboard")
        lines = done.stdout.splitlines()
        assert len(lines) == 1, done.stdout  # the link alone, on one line
        assert re.fullmatch(re.escape(self.origin) + r"/ui/sign-in/[A-Za-z0-9_-]{40,}", lines[0]), lines[0]
        return lines[0]

    def state(self, name: str) -> str:
        return str(self.server.cli_json("status", "deployment", name)["state"])

    def events(self, kind: str) -> list[dict[str, Any]]:
        out = self.server.cli("events", "--json").stdout
        return [
            e for e in (msgspec.json.decode(line) for line in out.splitlines() if line.strip()) if e["kind"] == kind
        ]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    tmp = tmp_path_factory.mktemp("dashboard")
    (tmp / "model").mkdir()
    world = World(tmp)
    world.server.start()
    try:
        world.server.cli("engine", "add", str(make_standin_venv(tmp / "vllm-venv", "vllm", "0.32.0")), "--name", "vllm")
        world.deploy("alpha")
        world.deploy("beta")
        yield world
    finally:
        world.server.stop()


@pytest.fixture(scope="module")
def playwright() -> Iterator[Playwright]:
    assert CHROMIUM.exists(), "Debian's chromium is missing: scripts/test installs it (apt-get install -y chromium)"
    with sync_playwright() as p:
        yield p


@pytest.fixture(scope="module")
def browser(playwright: Playwright) -> Iterator[Browser]:
    browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
    try:
        yield browser
    finally:
        browser.close()


class Watched:
    """A browser context whose every request, every answer 404 and every CSP complaint is recorded."""

    def __init__(self, browser: Browser, **options: Any) -> None:
        self.context: BrowserContext = browser.new_context(viewport={"width": 1200, "height": 800}, **options)
        self.requests: list[str] = []
        self.missing: list[str] = []
        self.csp: list[str] = []
        self.context.on("request", lambda request: self.requests.append(request.url))
        self.context.on(
            "response", lambda response: self.missing.append(response.url) if response.status == 404 else None
        )
        self.context.on(
            "console",
            lambda message: self.csp.append(message.text) if "Content Security Policy" in message.text else None,
        )

    def page(self) -> Page:
        page = self.context.new_page()
        page.on(
            "console",
            lambda message: self.csp.append(message.text) if "Content Security Policy" in message.text else None,
        )
        return page

    def check(self, origin: str) -> None:
        assert self.requests, "no request was recorded"
        strays = [url for url in self.requests if not url.startswith((origin + "/", f"blob:{origin}/"))]
        assert not strays, f"requests left the dashboard's origin: {strays}"
        assert not self.csp, f"Content-Security-Policy violations: {self.csp}"
        assert not [url for url in self.missing if url.endswith("/favicon.ico")], "the browser's icon is missing"


@pytest.fixture
def signed_in(browser: Browser, world: World) -> Iterator[tuple[Watched, Page]]:
    """A browser context signed in with the one-time link `capyctl dashboard` printed, on the fleet page."""
    watched = Watched(browser)
    try:
        page = watched.page()
        response = page.goto(world.sign_in_url())
        assert response is not None and response.status == 200 and page.url == world.origin + "/ui/"
        expect(page.locator("#live")).to_have_attribute("data-state", "live", timeout=5000)
        yield watched, page
        watched.check(world.origin)
    finally:
        watched.context.close()


def shoot(page: Page, name: str) -> None:
    IMAGES.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(IMAGES / f"dashboard-{name}.png"), full_page=True)


def card_state(page: Page, name: str) -> Any:
    return page.locator(f'article[data-deployment="{name}"] .card-body')


def test_the_fleet_shows_both_deployments_and_a_cli_stop_turns_a_card_stopped_live(
    world: World, signed_in: tuple[Watched, Page]
) -> None:
    _, page = signed_in
    world.server.cli("start", "deployment", "beta", "--wait")
    expect(card_state(page, "beta")).to_have_attribute("data-state", "ready", timeout=3000)
    names = page.locator("article.card").evaluate_all("cards => cards.map(c => c.dataset.deployment)")
    assert names == ["alpha", "beta"]
    expect(page.locator('article[data-deployment="beta"]')).to_contain_text("vllm 0.32.0")
    page.evaluate("window.capyctlMarker = 'no reload'")  # a reload would lose it
    shoot(page, "fleet")
    world.server.cli("stop", "deployment", "beta")
    expect(card_state(page, "beta")).to_have_attribute("data-state", "stopped", timeout=3000)
    assert page.evaluate("window.capyctlMarker") == "no reload"
    expect(page.locator('article[data-deployment="beta"]')).to_contain_text("stopped by an operator")
    expect(page.locator('article[data-deployment="beta"] button[data-action="stop"]')).to_be_disabled()


def test_the_park_button_confirmed_parks_the_engine_and_the_memory_bar_shows_it_parked(
    world: World, signed_in: tuple[Watched, Page]
) -> None:
    watched, page = signed_in
    world.server.cli("start", "deployment", "alpha", "--wait")
    expect(card_state(page, "alpha")).to_have_attribute("data-state", "ready", timeout=3000)
    page.locator('article[data-deployment="alpha"] a[data-action="park"]').click()
    expect(page.locator("h1")).to_have_text("Park alpha?")
    expect(page.locator(".consequences")).to_contain_text("It frees 3.00 GiB on gpu0")
    expect(page.locator(".consequences")).to_contain_text("0 requests in flight")
    shoot(page, "confirm")
    page.locator('button[data-confirm="park"]').click()
    page.wait_for_url(world.origin + "/ui/")
    expect(card_state(page, "alpha")).to_have_attribute("data-state", "parked", timeout=3000)
    assert world.state("alpha") == "parked"
    world.server.cli("start", "deployment", "beta", "--wait")  # fits beside alpha's parked 1 GiB
    page.goto(world.origin + "/ui/memory")
    parked = page.locator('svg.bar rect.seg[data-deployment="alpha"]')
    expect(parked).to_have_attribute("data-kind", "parked")
    expect(page.locator('svg.bar rect.seg[data-deployment="beta"]')).to_have_attribute("data-kind", "awake")
    expect(page.locator('table.legend tr[data-deployment="alpha"]')).to_contain_text("1.00 GiB")
    expect(page.locator("table.legend tr.free-row")).to_contain_text("1.50 GiB")
    shoot(page, "memory")
    actions = [e for e in world.events("dashboard_action") if e["detail"].get("action") == "park"]
    assert actions and re.fullmatch(r"[0-9a-f]{8}", actions[-1]["detail"]["session"]), actions
    session_cookie = next(c["value"] for c in watched.context.cookies() if c["name"] == "capyctl_session")
    assert session_cookie not in world.server.cli("events", "--json").stdout
    assert session_cookie not in world.server.log()


def test_stop_and_start_through_the_dashboard(world: World, signed_in: tuple[Watched, Page]) -> None:
    _, page = signed_in
    world.server.cli("start", "deployment", "beta", "--wait")
    expect(card_state(page, "beta")).to_have_attribute("data-state", "ready", timeout=3000)
    page.locator('article[data-deployment="beta"] a[data-action="stop"]').click()
    expect(page.locator(".consequences")).to_contain_text("0 requests in flight are cut")
    page.locator('button[data-confirm="stop"]').click()
    page.wait_for_url(world.origin + "/ui/")
    expect(card_state(page, "beta")).to_have_attribute("data-state", "stopped", timeout=3000)
    expect(page.locator('article[data-deployment="beta"] button[data-action="stop"]')).to_be_disabled()
    assert world.server.cli_json("status", "deployment", "beta")["operator_stopped"] is True
    page.locator('article[data-deployment="beta"] a[data-action="start"]').click()
    expect(page.locator(".consequences")).to_contain_text("lifts the operator's stop")
    page.locator('button[data-confirm="start"]').click()
    page.wait_for_url(world.origin + "/ui/")
    expect(card_state(page, "beta")).to_have_attribute("data-state", "ready", timeout=5000)
    asked = [e["detail"]["action"] for e in world.events("dashboard_action")]
    assert asked[-2:] == ["stop", "start"]


def test_a_deployment_added_or_deleted_appears_or_goes_without_a_reload(
    world: World, signed_in: tuple[Watched, Page]
) -> None:
    _, page = signed_in
    page.evaluate("window.capyctlMarker = 'no reload'")
    world.deploy("gamma")
    try:
        expect(card_state(page, "gamma")).to_have_attribute("data-state", "stopped", timeout=3000)
    finally:
        world.server.cli("delete", "deployment", "gamma")
    expect(page.locator('article[data-deployment="gamma"]')).to_have_count(0, timeout=3000)
    assert page.evaluate("window.capyctlMarker") == "no reload"


def test_every_dashboard_answer_carries_the_security_headers(world: World) -> None:
    answers = [
        httpx.get(world.origin + path)
        for path in ("/ui/sign-in", "/ui/", "/ui/nowhere", "/ui/static/app.css", "/ui/stream")
    ]
    answers.append(httpx.get(world.origin + "/ui/", headers={"host": "elsewhere.example"}))
    for answer in answers:
        csp = answer.headers.get("content-security-policy", "")
        assert "script-src 'self'" in csp and "default-src 'none'" in csp, answer.request.url
        assert answer.headers["referrer-policy"] == "no-referrer" and answer.headers["x-frame-options"] == "DENY"


def cut_connections(port: int) -> None:
    """Drop every TCP connection to ``port`` at once, both ends (as a network failure would), with iproute2."""
    done = subprocess.run(
        ["ss", "-K", "-t", "state", "established", f"( sport = :{port} or dport = :{port} )"],
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert done.returncode == 0, done.stderr


def test_a_dropped_stream_is_reported_and_the_page_catches_up_when_it_returns(
    world: World, signed_in: tuple[Watched, Page]
) -> None:
    _, page = signed_in
    world.server.cli("stop", "deployment", "beta")
    expect(card_state(page, "beta")).to_have_attribute("data-state", "stopped", timeout=3000)
    page.route("**/ui/stream*", lambda route: route.abort())  # the way back stays closed for now
    cut_connections(world.server.management_port)
    expect(page.locator("#live")).to_have_attribute("data-state", "dropped", timeout=5000)
    expect(page.locator("#live")).to_contain_text("live updates lost")
    world.server.cli("start", "deployment", "beta", "--wait")  # a change the page cannot see yet
    expect(card_state(page, "beta")).to_have_attribute("data-state", "stopped")
    page.unroute("**/ui/stream*")
    expect(page.locator("#live")).to_have_attribute("data-state", "live", timeout=10000)
    expect(card_state(page, "beta")).to_have_attribute("data-state", "ready", timeout=3000)


def test_keys_and_events_pages(world: World, signed_in: tuple[Watched, Page]) -> None:
    _, page = signed_in
    secret = world.server.cli("create", "key", "team-a", "--daily-limit", "2").stdout.strip()
    world.server.cli("start", "deployment", "alpha", "--wait")
    page.goto(world.origin + "/ui/keys")
    row = page.locator('tr[data-key="team-a"]')
    expect(row.locator("td").nth(1)).to_have_text("0")
    question = {"model": "alpha", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    codes = [
        httpx.post(
            world.server.base_url + "/v1/chat/completions",
            json=question,
            timeout=30,
            headers={"authorization": f"Bearer {secret}"},
        ).status_code
        for _ in range(4)
    ]
    assert codes == [200, 200, 429, 429]
    expect(row.locator("td")).to_have_text(
        ["team-a", "2", "2", "0", "2", re.compile(r"\d{4}-\d\d-\d\d .+ UTC"), "all"], timeout=3000
    )  # live: calls, limit, under way, refused
    assert len(secret) > 20 and secret not in page.content() and secret[-30:] not in page.content()
    shoot(page, "keys")
    page.goto(world.origin + "/ui/events")
    expect(page.locator('section.timeline[data-deployment=""] li[data-kind="daily_limit_reached"]')).to_have_count(1)
    page.goto(world.origin + "/ui/events?deployment=alpha")
    expect(
        page.locator('section.timeline[data-deployment="alpha"] li[data-kind="state_changed"]').first
    ).to_be_visible()
    world.server.cli("stop", "deployment", "alpha")
    expect(page.locator('li[data-kind="operator_stop"]').first).to_be_visible(timeout=3000)
    log_link = page.locator('li[data-kind="state_changed"] a', has_text="log").first
    shoot(page, "events")
    log_link.click()
    expect(page.locator("h1")).to_contain_text("Log of alpha")
    expect(page.locator("pre.log")).not_to_be_empty()


def cell(value: Any, digits: int = 1) -> str:
    """A record's figure as the requests table shows it: a dash when nobody measured it."""
    if value is None:
        return "–"
    return str(value) if isinstance(value, int) else f"{value:.{digits}f}"


def test_a_chat_request_appears_live_in_the_requests_table_and_filters_narrow_it(
    world: World, signed_in: tuple[Watched, Page]
) -> None:
    watched, page = signed_in
    world.server.cli("start", "deployment", "alpha", "--wait")
    page.goto(world.origin + "/ui/requests")
    expect(page.locator("#live")).to_have_attribute("data-state", "live", timeout=5000)
    page.evaluate("window.capyctlMarker = 'no reload'")
    question = {"model": "alpha", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    answer = httpx.post(
        world.server.base_url + "/v1/chat/completions", json=question, timeout=30, headers=world.server.headers()
    )
    assert answer.status_code == 200, answer.text
    unknown = httpx.post(
        world.server.base_url + "/v1/chat/completions",
        json={**question, "model": "nope"},
        timeout=30,
        headers=world.server.headers(),
    )
    assert unknown.status_code == 404
    request_id, refused_id = answer.headers["x-capyctl-request-id"], unknown.headers["x-capyctl-request-id"]
    row, refused = page.locator(f'tr[data-id="{request_id}"]'), page.locator(f'tr[data-id="{refused_id}"]')
    expect(row).to_be_visible(timeout=3000)  # live: the page was not reloaded
    expect(refused).to_be_visible(timeout=3000)
    assert page.evaluate("window.capyctlMarker") == "no reload"
    ttft = answer.json()["capyctl"]["metrics"]["ttft_ms"]["value"]
    assert ttft > 0
    record = next(r for r in world.server.cli_json("list", "requests") if r["id"] == request_id)
    expect(row.locator("td")).to_have_text(
        [
            re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d$"),
            "default",
            "alpha",
            "200",
            "ok",
            cell(record["queue_wait_ms"]),
            cell(record["queue_ms"]),
            cell(ttft),
            cell(record["decode_tokens_per_second"]),
            cell(record["prompt_tokens"]),
            cell(record["cached_tokens"]),
            cell(record["completion_tokens"]),
            "–",
            "–",
        ]
    )
    expect(refused.locator("td.ttft")).to_have_text("–")  # never measured: not 0
    expect(refused.locator("td.code")).to_have_text("model_not_found")
    shoot(page, "requests")

    page.fill('form.filters input[name="deployment"]', "alpha")
    page.click('form.filters button[type="submit"]')  # a plain GET form: its blank fields are no filter
    page.wait_for_url(re.compile(r".*/ui/requests\?deployment=alpha&.*"))
    expect(row).to_be_visible()
    expect(refused).to_have_count(0)
    deployments = page.locator("table.requests tbody tr").evaluate_all("rows => rows.map(r => r.dataset.deployment)")
    assert deployments and set(deployments) == {"alpha"}, deployments
    page.goto(world.origin + "/ui/requests?status=404")
    expect(refused).to_be_visible()
    expect(row).to_have_count(0)

    page.goto(world.origin + "/ui/requests")
    row.locator("td.at a").click()  # its detail
    page.wait_for_url(world.origin + f"/ui/requests/{request_id}")
    expect(page.locator("h1")).to_have_text(f"Request {request_id}")
    expect(page.locator('tr[data-field="ttft_ms"] td')).to_have_text(f"{ttft:g}")
    expect(page.locator('tr[data-field="deployment"] td')).to_have_text("alpha")
    expect(page.locator('tr[data-field="cause"] td')).to_have_text("–")
    shoot(page, "request")
    page.goto(world.origin + "/ui/requests")
    page.fill('form.find input[name="id"]', refused_id)  # the search box takes an ID
    page.click('form.find button[type="submit"]')
    page.wait_for_url(world.origin + f"/ui/requests/{refused_id}")
    expect(page.locator('tr[data-field="code"] td')).to_have_text("model_not_found")
    missing = page.goto(world.origin + "/ui/requests/01M933CJQKSSDYEE55TA4Z8SRH")
    assert missing is not None and missing.status == 404
    expect(page.locator(".error")).to_contain_text("no request record")

    page.goto(world.origin + "/ui/")  # the card sums up the last 5 minutes from the same records
    rows = world.server.cli_json("list", "requests", "--deployment", "alpha", "--since", "5m")
    ttfts = sorted(r["ttft_ms"] for r in rows if r["ttft_ms"] is not None)
    recent = page.locator("#card-alpha .recent")
    expect(recent).to_contain_text(f"{len(rows)} request")  # the world's other tests chatted with alpha too
    expect(recent.locator(".ttft")).to_have_text(f"{ttfts[(len(ttfts) + 1) // 2 - 1]:.1f}")  # nearest-rank p50


def test_a_bad_requests_filter_is_refused_naming_the_parameter(world: World, signed_in: tuple[Watched, Page]) -> None:
    watched, page = signed_in
    for query, name in (
        ("status=abc", "status"),
        ("since=soon", "since"),
        ("limit=0", "limit"),
        ("colour=red", "colour"),
        ("key=a&key=b", "key"),
        ("id=", "id"),
    ):
        response = page.goto(f"{world.origin}/ui/requests?{query}")
        assert response is not None and response.status == 400, query
        expect(page.locator("h1")).to_have_text("Not understood")
        expect(page.locator('.error[data-code="invalid_request"]')).to_have_text(re.compile(rf"^'?{name}'?[: ]"))
    stream = watched.context.request.get(f"{world.origin}/ui/stream?page=requests&status=abc")
    assert stream.status == 400 and stream.json()["error"]["param"] == "status"


def test_the_charts_page_draws_a_deployments_requests_with_its_park_and_wake_marked(
    world: World, signed_in: tuple[Watched, Page]
) -> None:
    watched, page = signed_in
    world.server.cli("start", "deployment", "alpha", "--wait")
    assert world.server.cli_json("park", "deployment", "alpha")["state"] == "parked"
    world.server.cli("start", "deployment", "alpha", "--wait")  # its wake
    question = {"model": "alpha", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
    answer = httpx.post(
        world.server.base_url + "/v1/chat/completions", json=question, timeout=30, headers=world.server.headers()
    )
    assert answer.status_code == 200, answer.text
    source = world.origin + "/ui/charts/data?window=15m&deployment=alpha"
    deadline, data = time.monotonic() + 5, {}
    while time.monotonic() < deadline:  # the record is written off the request's path: poll, bounded
        got = watched.context.request.get(source)
        assert got.status == 200 and got.headers["content-type"].startswith("application/json")
        data = got.json()
        if data["deployments"] and max(data["deployments"][0]["series"]["requests_per_second"]) > 0:
            break
        time.sleep(0.1)
    (alpha,) = data["deployments"]
    assert alpha["name"] == "alpha" and alpha["requests"] >= 1 and data["window"] == "15m"
    assert max(alpha["series"]["requests_per_second"]) > 0 and max(v or 0 for v in alpha["series"]["ttft_p50_ms"]) > 0
    assert len(data["times"]) == len(alpha["series"]["requests_per_second"]) == 30
    expected = {
        (kind, round(e["at"], 3))
        for kind in ("parked", "woken", "switch_completed")
        for e in world.events(kind)
        if e["deployment"] == "alpha" and data["start"] <= e["at"] < data["end"]
    }
    assert {(m["event"], round(m["at"], 3)) for m in alpha["marks"]} == expected
    assert {"park", "wake"} <= {m["kind"] for m in alpha["marks"]}

    page.goto(world.origin + "/ui/charts?window=15m")
    expect(page.locator("nav a[aria-current=page]")).to_have_text("Charts")
    expect(page.locator("#charts")).to_have_attribute("data-state", "drawn", timeout=5000)
    section = page.locator('section.chart[data-deployment="alpha"]')
    expect(section).to_have_attribute("data-drawn", "4")
    expect(section.locator(".uplot .u-title")).to_have_text(
        ["TTFT (ms)", "Decode (tokens/s)", "Requests per second", "CapyCTL's wait in line (ms)"]
    )
    expect(section.locator("canvas")).to_have_count(4)
    expect(section.locator('ul.marks li[data-kind="park"]').first).to_contain_text("parked")
    expect(section.locator('ul.marks li[data-kind="wake"]').first).to_contain_text("woken")
    expect(page.locator('section.chart[data-deployment="beta"]')).to_have_attribute("data-drawn", "4")
    shoot(page, "charts")
    page.goto(world.origin + "/ui/charts?window=1h&deployment=alpha")
    expect(page.locator("section.chart")).to_have_count(1)
    expect(page.locator('select[name="window"]')).to_have_value("1h")

    for query, name in (("window=2h", "window"), ("colour=red", "colour"), ("window=1h&window=24h", "window")):
        response = page.goto(f"{world.origin}/ui/charts?{query}")
        assert response is not None and response.status == 400, query
        expect(page.locator("h1")).to_have_text("Not understood")
        expect(page.locator('.error[data-code="invalid_request"]')).to_have_text(re.compile(rf"^'?{name}'?[: ]"))
    refused = watched.context.request.get(world.origin + "/ui/charts/data?window=2h")
    assert refused.status == 400 and refused.json()["error"]["param"] == "window"


def test_without_a_session_every_page_and_the_stream_are_refused(world: World, browser: Browser) -> None:
    watched = Watched(browser)
    try:
        page = watched.page()
        for path in [
            *PAGES,
            "/ui/deployments/alpha/park",
            "/ui/events?deployment=alpha",
            "/ui/requests?deployment=alpha",
            "/ui/requests/01M933CJQKSSDYEE55TA4Z8SRH",
            "/ui/requests?id=x",
        ]:
            response = page.goto(world.origin + path)
            assert response is not None and response.status == 401, path
            expect(page.locator("form.signin")).to_be_visible()
        shoot(page, "sign-in")
        data = watched.context.request.get(world.origin + "/ui/charts/data?window=15m")
        assert data.status == 401 and data.json()["error"]["code"] == "sign_in_needed"
        for page_name in ("fleet", "memory", "keys", "events", "requests"):
            refused = watched.context.request.get(f"{world.origin}/ui/stream?page={page_name}")
            assert refused.status == 401, page_name
            assert refused.json()["error"]["code"] == "sign_in_needed"
        posted = watched.context.request.post(world.origin + "/ui/deployments/alpha/start", form={"csrf": "x"})
        assert posted.status == 401
        api_key = watched.context.request.post(world.origin + "/ui/sign-in", form={"token": world.server.api_key})
        assert api_key.status == 401 and "not this server" in api_key.text()
        assert not [c for c in watched.context.cookies() if c["name"] == "capyctl_session"]
        watched.check(world.origin)
    finally:
        watched.context.close()


def test_a_post_without_the_csrf_token_is_refused(world: World, signed_in: tuple[Watched, Page]) -> None:
    watched, _ = signed_in
    before = len(world.events("dashboard_action"))
    for form in ({}, {"csrf": "not-the-token"}):
        refused = watched.context.request.post(world.origin + "/ui/deployments/beta/stop", form=form)
        assert refused.status == 403, refused.text()
        assert "CSRF" in refused.text()
    assert len(world.events("dashboard_action")) == before  # the refusal came before anything was done


def test_a_sign_in_link_works_once(world: World, browser: Browser) -> None:
    url = world.sign_in_url()
    first, second = Watched(browser), Watched(browser)
    try:
        page = first.page()
        response = page.goto(url)
        assert response is not None and response.status == 200 and page.url.endswith("/ui/")
        again = second.page()
        reused = again.goto(url)
        assert reused is not None and reused.status == 401
        expect(again.locator(".error")).to_contain_text("used already or has expired")
        assert url.rsplit("/", 1)[1] not in world.server.log()
        second.check(world.origin)
    finally:
        first.context.close()
        second.context.close()


def test_the_admin_token_signs_in_and_sign_out_ends_the_session(world: World, browser: Browser) -> None:
    watched = Watched(browser)
    try:
        page = watched.page()
        page.goto(world.origin + "/ui/sign-in")
        token = (world.server.state_dir / "identity" / "admin-token").read_text().strip()
        page.fill('input[name="token"]', token)
        page.click('form.signin button[type="submit"]')
        page.wait_for_url(world.origin + "/ui/")
        cookie = next(c for c in watched.context.cookies() if c["name"] == "capyctl_session")
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and cookie["value"] != token
        page.click("form.signout button")
        page.wait_for_url(world.origin + "/ui/sign-in")
        assert page.goto(world.origin + "/ui/").status == 401  # type: ignore[union-attr]
        watched.check(world.origin)
    finally:
        watched.context.close()


def test_the_management_api_keeps_the_admin_token_and_other_hosts_are_refused(world: World) -> None:
    token = (world.server.state_dir / "identity" / "admin-token").read_text().strip()
    api = httpx.get(world.origin + "/deployments", headers={"authorization": f"Bearer {token}"})
    assert api.status_code == 200 and {d["name"] for d in api.json()} == {"alpha", "beta"}
    for accept in ("*/*", "application/json"):  # "/" is the dashboard's for browsers only
        plain = httpx.get(world.origin + "/", headers={"accept": accept, "authorization": f"Bearer {token}"})
        assert plain.status_code == 404 and plain.json()["error"]["code"] == "not_found"
    for path, status in (("/ui/", 401), ("/ui/nowhere", 404), ("/ui/deployments/alpha/explode", 401)):
        answer = httpx.get(world.origin + path)  # not a browser: CapyCTL's JSON error envelope
        assert answer.status_code == status and "code" in answer.json()["error"], path
    rebound = httpx.get(world.origin + "/ui/", headers={"host": f"attacker.example:{world.server.management_port}"})
    assert rebound.status_code == 421 and rebound.json()["error"]["code"] == "wrong_host"
    page = httpx.get(world.origin + "/ui/sign-in")
    csp = page.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "unsafe-inline" not in csp


def test_a_stalled_browser_never_delays_inference(world: World) -> None:
    """A stream whose reader never reads holds its data in its own socket; chat requests meanwhile are
    answered as usual, and the dashboard still answers other browsers."""
    cookies = httpx.get(world.sign_in_url(), follow_redirects=False).cookies
    world.server.cli("start", "deployment", "alpha", "--wait")
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, never read
    try:
        stalled.connect(("127.0.0.1", world.server.management_port))
        stalled.sendall(
            f"GET /ui/stream?page=keys HTTP/1.1\r\nHost: 127.0.0.1:{world.server.management_port}\r\n"
            f"Cookie: capyctl_session={cookies['capyctl_session']}\r\n\r\n".encode()
        )
        local_port = stalled.getsockname()[1]
        question = {"model": "alpha", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4}
        waited = []
        deadline = time.monotonic() + 60
        while not backlog(world.server.management_port, local_port):  # each answer counts on the keys page
            assert time.monotonic() < deadline, "the stalled stream never filled its socket"
            began = time.monotonic()
            answer = httpx.post(
                world.server.base_url + "/v1/chat/completions",
                headers=world.server.headers(),
                json=question,
                timeout=30,
            )
            waited.append(time.monotonic() - began)
            assert answer.status_code == 200, answer.text
        for _ in range(20):  # and with the socket full, the same
            began = time.monotonic()
            answer = httpx.post(
                world.server.base_url + "/v1/chat/completions",
                headers=world.server.headers(),
                json=question,
                timeout=30,
            )
            waited.append(time.monotonic() - began)
            assert answer.status_code == 200, answer.text
        assert backlog(world.server.management_port, local_port), "the stream is not stalled any more"
        assert max(waited) < 5, waited
        assert httpx.get(world.origin + "/ui/", cookies=cookies).status_code == 200
    finally:
        stalled.close()


def backlog(server_port: int, client_port: int) -> bool:
    """Whether the server's end of that connection holds bytes the client has not taken (ss's Send-Q)."""
    done = subprocess.run(
        ["ss", "-tnH", "state", "established", f"( sport = :{server_port} and dport = :{client_port} )"],
        capture_output=True,
        text=True,
        timeout=10,
    )
    return any(int(line.split()[1]) > 0 for line in done.stdout.splitlines() if line.split())


def test_capyctl_dashboard_json_and_without_a_server(world: World, tmp_path: Path) -> None:
    link = world.server.cli_json("dashboard")
    assert link["expires_in_s"] == 60 and link["url"].startswith(world.origin + "/ui/sign-in/")
    assert httpx.get(link["url"], follow_redirects=False).status_code == 303  # a good link, once
    nothing = CapyServer(tmp_path / "nothing")
    done = nothing.cli("dashboard", "--json", check=False)
    assert done.returncode == 3 and "capyctl start standalone" in done.stderr
    assert msgspec.json.decode(done.stdout)["error"]["code"] == "server_not_running"


def test_the_charts_page_is_live_and_a_park_is_marked_and_drawn_without_a_reload(
    world: World, signed_in: tuple[Watched, Page]
) -> None:
    watched, page = signed_in
    world.server.cli("start", "deployment", "alpha", "--wait")
    page.goto(world.origin + "/ui/charts?window=15m&deployment=alpha")
    expect(page.locator("#live")).to_have_attribute("data-state", "live", timeout=5000)
    expect(page.locator("#live")).to_have_text("live")
    expect(page.locator("#charts")).to_have_attribute("data-state", "drawn", timeout=5000)
    parks = page.locator('section.chart[data-deployment="alpha"] ul.marks li[data-kind="park"]')
    before = parks.count()
    fetched = lambda: len([u for u in watched.requests if "/ui/charts/data?" in u])  # noqa: E731
    drawn = fetched()
    page.evaluate("window.capyctlMarker = 'no reload'")
    assert world.server.cli_json("park", "deployment", "alpha")["state"] == "parked"
    expect(parks).to_have_count(before + 1, timeout=5000)
    deadline = time.monotonic() + 5
    while fetched() == drawn and time.monotonic() < deadline:  # drawn again at once, not 30 s later
        page.wait_for_timeout(100)
    assert fetched() > drawn and page.evaluate("window.capyctlMarker") == "no reload"


def test_a_standalone_capyctl_has_a_hosts_page_that_says_hosts_need_a_server(
    world: World, signed_in: tuple[Watched, Page]
) -> None:
    watched, page = signed_in
    response = page.goto(world.origin + "/ui/hosts")
    assert response is not None and response.status == 200
    expect(page.locator("nav a[aria-current=page]")).to_have_text("Hosts")
    expect(page.locator("#hosts")).to_contain_text("capyctl start server")
    expect(page.locator("form.invite")).to_have_count(0)
    expect(page.locator("#live")).to_have_attribute("data-state", "static")  # nothing there changes
    refused = watched.context.request.get(world.origin + "/ui/hosts/gpu-a/revoke")
    assert refused.status == 400 and refused.json()["error"]["code"] == "invalid_config"


def test_a_wrong_method_gets_405_naming_the_methods_the_path_takes(world: World) -> None:
    token = (world.server.state_dir / "identity" / "admin-token").read_text().strip()
    asked = [
        ("POST", world.origin + "/ui/memory", {}),
        ("DELETE", world.origin + "/ui/deployments/alpha/park", {}),
        ("PUT", world.origin + "/ui/static/app.css", {}),
        ("POST", world.origin + "/devices", {"authorization": f"Bearer {token}"}),  # the management API
        ("POST", world.server.base_url + "/v1/models", world.server.headers()),  # the inference API's own
        ("DELETE", world.server.base_url + "/health", {}),
        ("GET", world.server.base_url + "/v1/chat/completions", world.server.headers()),
    ]  # the front door's
    for method, url, headers in asked:
        answer = httpx.request(method, url, headers=headers)
        assert answer.status_code == 405, (method, url, answer.text)
        allowed = {m.strip() for m in answer.headers.get("allow", "").split(",") if m.strip()}
        assert allowed and method not in allowed, (method, url, answer.headers)
        error = answer.json()["error"]
        assert (error["code"], error["type"]) == ("method_not_allowed", "invalid_request_error"), (method, url)
    assert httpx.get(world.server.base_url + "/v1/chat/completions").headers["allow"] == "POST"
    page = httpx.post(world.origin + "/ui/keys", headers={"accept": "text/html"})  # a browser gets a page
    assert page.status_code == 405 and "GET" in page.headers["allow"] and "text/html" in page.headers["content-type"]
    assert "content-security-policy" in page.headers


def test_the_dashboards_refusals_carry_the_type_their_status_gives(
    world: World, signed_in: tuple[Watched, Page]
) -> None:
    watched, _ = signed_in
    signed_out = httpx.get(world.origin + "/ui/")
    assert signed_out.status_code == 401
    assert signed_out.json()["error"] | {"message": ""} == {
        "code": "sign_in_needed",
        "type": "invalid_request_error",
        "message": "",
    }
    refused = httpx.post(world.origin + "/ui/sign-in", data={"token": "nope"})
    assert (refused.status_code, refused.json()["error"]["type"]) == (401, "invalid_request_error")
    forged = watched.context.request.post(world.origin + "/ui/deployments/beta/stop", form={"csrf": "x"})
    assert forged.status == 403
    assert (forged.json()["error"]["code"], forged.json()["error"]["type"]) == ("csrf_refused", "invalid_request_error")


def test_the_browsers_icon_is_served_and_named_by_every_page(world: World, signed_in: tuple[Watched, Page]) -> None:
    _, page = signed_in
    for path in ("/favicon.ico", "/ui/static/favicon.ico"):
        icon = httpx.get(world.origin + path)
        assert icon.status_code == 200 and icon.headers["content-type"] == "image/x-icon", path
        assert icon.content[:4] == b"\0\0\1\0"  # an ICO file's header
    for path in PAGES:
        page.goto(world.origin + path)
        expect(page.locator('link[rel="icon"]')).to_have_attribute("href", "/ui/static/favicon.ico")
