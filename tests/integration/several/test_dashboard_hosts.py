"""The dashboard's Hosts page in a real Chromium (Debian's, driven by Playwright), against a server of several
machines in network namespaces: a host's state follows its agent live (frozen with SIGSTOP it goes
suspended, and online again on SIGCONT, without a reload), a revoke asks first and a cancelled one does
nothing, a drain and an undrain done from the page show as they take effect, and an invitation's join file
is shown once and joins a machine.

The browser runs in the test's own namespace, so the server's management listener (where the dashboard is)
listens on the server's address on the test's link (``--management``), not on its loopback.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from playwright.sync_api import Browser, Locator, Page, expect

from tests.fakes.standin_venv import make_standin_venv
from tests.integration.machines import CONTROL_PORT, Machine, hosts, joined, until
from tests.integration.netns import Lan
from tests.integration.several.conftest import start_server
from tests.integration.test_dashboard import Watched, browser, playwright, shoot  # noqa: F401 (the browser's fixtures)

pytestmark = pytest.mark.integration
MANAGEMENT_PORT = 7443
DEVICE = "memory:\n  devices:\n    - name: gpu0\n      capacity: 10GiB\n"
LIVE = 10_000  # ms the page has to follow a change (suspend_after is 2 s here)


@pytest.fixture
def server(lan: Lan, tmp_path: Path) -> Iterator[Machine]:
    """The several-machines suite's server, its management listener (and the dashboard) on its address."""
    yield start_server(lan, tmp_path, "--management", f"{lan.server.address}:{MANAGEMENT_PORT}")


@pytest.fixture
def gpu_a(lan: Lan, server: Machine, tmp_path: Path) -> Machine:
    """gpu-a joined with a 10 GiB gpu0, a stand-in vLLM there, and a 6 GiB deployment on it, ready."""
    host = joined(lan, server, "gpu-a", tmp_path, config=DEVICE)
    server.cli(
        "engine",
        "add",
        str(make_standin_venv(tmp_path / "vllm-a", "vllm", "0.32.0")),
        "--host",
        "gpu-a",
        "--name",
        "vllm",
    )
    spec = tmp_path / "chat-a.yaml"
    spec.write_bytes(
        msgspec.yaml.encode(
            {
                "name": "chat-a",
                "engine": "vllm",
                "model": str(tmp_path / "model"),
                "host": "gpu-a",
                "resources": {"memory": "6GiB"},
            }
        )
    )
    server.cli("deploy", "model", "--file", str(spec), "--activate", "--wait", timeout=120)
    return host


@pytest.fixture
def signed_in(browser: Browser, server: Machine, lan: Lan) -> Iterator[tuple[Watched, Page, str]]:  # noqa: F811
    """A browser signed in with the link `capyctl dashboard` printed on the server, and the dashboard's origin."""
    origin = f"http://{lan.server.address}:{MANAGEMENT_PORT}"
    watched = Watched(browser, accept_downloads=True)
    try:
        page = watched.page()
        link = server.cli("dashboard").stdout.strip()
        assert link.startswith(origin + "/ui/sign-in/"), link
        response = page.goto(link)
        assert response is not None and response.status == 200 and page.url == origin + "/ui/"
        yield watched, page, origin
        watched.check(origin)
    finally:
        watched.context.close()


def card(page: Page, name: str) -> Locator:
    return page.locator(f'article[data-host="{name}"]')


def test_a_hosts_state_follows_its_agent_live_and_a_revoke_asks_first(
    lan: Lan, server: Machine, gpu_a: Machine, signed_in: tuple[Watched, Page, str]
) -> None:
    _, page, origin = signed_in
    expect(page.locator('article[data-deployment="chat-a"] dd.host')).to_have_text("gpu-a")  # the fleet card
    page.goto(origin + "/ui/hosts")
    expect(page.locator("#live")).to_have_attribute("data-state", "live", timeout=5000)
    a = card(page, "gpu-a")
    expect(a.locator(".state")).to_have_text("online")
    expect(a.locator("dd.address")).to_have_text(lan.hosts["gpu-a"].address)
    expect(a.locator("dd.devices")).to_have_text("gpu0 6.00 GiB of 10.00 GiB")
    expect(a.locator("dd.deployments")).to_have_text("chat-a")
    expect(a.locator("dd.engines")).to_have_text("vllm (vllm 0.32.0)")
    expect(a.locator("dd.heard")).to_contain_text(" s ago")
    shoot(page, "hosts")
    page.evaluate("window.capyctlMarker = 'no reload'")
    assert gpu_a.process is not None
    gpu_a.process.send_signal(signal.SIGSTOP)
    try:
        expect(a.locator(".state")).to_have_text("suspended", timeout=LIVE)
        expect(a.locator(".card-body")).to_have_class("card-body state-suspended")
    finally:
        gpu_a.process.send_signal(signal.SIGCONT)
    expect(a.locator(".state")).to_have_text("online", timeout=LIVE)
    assert page.evaluate("window.capyctlMarker") == "no reload"

    a.locator('a[data-action="revoke"]').click()  # asked, then cancelled: nothing happens
    expect(page.locator("h1")).to_have_text("Revoke gpu-a?")
    expect(page.locator(".consequences")).to_contain_text("chat-a")
    page.locator('a[data-cancel="revoke"]').click()
    page.wait_for_url(origin + "/ui/hosts")
    expect(a.locator(".state")).to_have_text("online")
    assert hosts(server)["gpu-a"]["state"] == "online" and gpu_a.process.poll() is None

    a.locator('a[data-action="revoke"]').click()  # asked, then confirmed
    page.locator('button[data-confirm="revoke"]').click()
    page.wait_for_url(origin + "/ui/hosts")
    expect(a.locator(".state")).to_have_text("revoked", timeout=LIVE)
    expect(a.locator('button[data-action="revoke"]')).to_be_disabled()
    assert hosts(server)["gpu-a"]["state"] == "revoked"
    until(lambda: gpu_a.process.poll() is not None, 15, "the revoked host's agent exits")  # type: ignore[union-attr]
    done = [json.loads(line) for line in server.cli("events", "--json").stdout.splitlines() if line.strip()]
    asked = [e["detail"] for e in done if e["kind"] == "dashboard_action"]
    assert [(d["action"], d["host"]) for d in asked] == [("revoke_host", "gpu-a")]


def test_a_host_is_drained_and_undrained_from_the_browser_and_the_page_follows(
    lan: Lan, server: Machine, gpu_a: Machine, signed_in: tuple[Watched, Page, str]
) -> None:
    _, page, origin = signed_in
    page.goto(origin + "/ui/hosts")
    expect(page.locator("#live")).to_have_attribute("data-state", "live", timeout=5000)
    a = card(page, "gpu-a")
    expect(a.locator(".drain")).to_have_count(0)
    a.locator('a[data-action="drain"]').click()
    expect(page.locator("h1")).to_have_text("Drain gpu-a?")
    expect(page.locator(".consequences")).to_contain_text("chat-a")
    page.locator('button[data-confirm="drain"]').click()
    page.wait_for_url(origin + "/ui/hosts")
    expect(a.locator(".drain")).to_have_text("drained", timeout=LIVE)  # its one instance stopped: none left there
    expect(a.locator('a[data-action="undrain"]')).to_be_visible()
    shown = json.loads(server.cli("status", "deployment", "chat-a", "--json").stdout)
    assert shown["instances"] == [] and "drained by an operator" in shown["unplaced"][0]
    assert hosts(server)["gpu-a"]["drain"] == "drained"

    a.locator('a[data-action="undrain"]').click()
    expect(page.locator("h1")).to_have_text("Undrain gpu-a?")
    page.locator('button[data-confirm="undrain"]').click()
    page.wait_for_url(origin + "/ui/hosts")
    expect(a.locator(".drain")).to_have_count(0, timeout=LIVE)
    until(
        lambda: (
            [i["state"] for i in json.loads(server.cli("status", "deployment", "chat-a", "--json").stdout)["instances"]]
            == ["ready"]
        ),
        60,
        "chat-a placed and ready on gpu-a again",
    )
    done = [json.loads(line) for line in server.cli("events", "--json").stdout.splitlines() if line.strip()]
    asked = [(e["detail"]["action"], e["detail"]["host"]) for e in done if e["kind"] == "dashboard_action"]
    assert asked == [("drain_host", "gpu-a"), ("undrain_host", "gpu-a")]


def test_an_invitation_is_confirmed_shown_once_and_joins_a_machine(
    lan: Lan, server: Machine, signed_in: tuple[Watched, Page, str], tmp_path: Path
) -> None:
    watched, page, origin = signed_in
    page.goto(origin + "/ui/hosts")
    expect(page.locator("#hosts")).to_contain_text("No host has joined yet")
    address = f"{lan.server_address_for['gpu-b']}:{CONTROL_PORT}"  # as gpu-b reaches the server
    page.fill('form.invite input[name="name"]', "gpu-c")
    page.fill('form.invite input[name="ttl"]', "10m")
    page.fill('form.invite input[name="server"]', address)
    page.click('form.invite button[type="submit"]')
    expect(page.locator("h1")).to_have_text("Invite gpu-c?")
    expect(page.locator(".consequences")).to_contain_text("it works once, for 10 min")
    before = server.cli("events", "--json").stdout
    assert "invite_host" not in before and "host_invited" not in before  # nothing is made before the confirmation
    with page.expect_response(lambda r: r.url == origin + "/ui/hosts/invite" and r.request.method == "POST") as posted:
        page.click('button[data-confirm="invite"]')
    assert posted.value.status == 200 and posted.value.headers["cache-control"] == "no-store"  # the browser keeps none
    expect(page.locator("h1")).to_have_text("Join file for gpu-c")
    shown = page.locator("textarea#join-file").input_value()
    join = json.loads(shown)
    assert (join["host"], join["server"]) == ("gpu-c", address) and len(join["secret"]) > 20
    assert join["secret"] not in page.url and join["secret"] not in server.read_log()
    assert join["secret"] not in server.cli("events", "--json").stdout
    with page.expect_download() as downloading:
        page.click('button[data-download="join-file"]')
    assert downloading.value.suggested_filename == "gpu-c.join"
    saved = tmp_path / "gpu-c.join"
    downloading.value.save_as(saved)
    assert json.loads(saved.read_text()) == join
    machine = Machine(lan.hosts["gpu-b"], tmp_path / "gpu-c")  # the file joins gpu-b's machine as gpu-c
    machine.cli("join", "host", "--join-file", str(saved))
    assert "gpu-c" in hosts(server)
    page.goto(origin + "/ui/hosts")
    expect(card(page, "gpu-c")).to_be_visible()
    assert join["secret"] not in page.content()
    for path, form in (("/ui/hosts/invite", {"name": "gpu-d", "server": address}), ("/ui/hosts/gpu-c/revoke", {})):
        forged = watched.context.request.post(origin + path, form=form)  # without the session's CSRF token
        assert forged.status == 403 and forged.json()["error"]["code"] == "csrf_refused", path
    assert "gpu-d" not in server.cli("events", "--json").stdout and hosts(server)["gpu-c"]["state"] != "revoked"
