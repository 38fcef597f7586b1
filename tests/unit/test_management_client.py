"""The CLI's client of the management API (``entrypoints/cli/client.py``, on the standard library's
``http.client``), against a stand-in API on loopback that records what it was sent."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from capyctl.adapters.storage.state_dir import StateDir
from capyctl.entrypoints.cli.client import ManagementClient, ServerError, ServerNotRunning
from tests.fakes.management_api import Seen, management_api


class Api:
    """What the stand-in answers next."""

    def __init__(self) -> None:
        self.seen: list[Seen] = []
        self.status = 200
        self.answer: bytes = b"{}"


@pytest.fixture
def api(tmp_path: Path) -> Iterator[tuple[Path, Api]]:
    state = StateDir(tmp_path / "state")
    state.prepare()
    state.admin_token()  # made at a server's first start
    record = Api()
    with management_api(state, lambda seen: (record.status, record.answer)) as seen:
        record.seen = seen
        yield state.root, record


def test_a_call_sends_the_token_the_json_body_and_the_query(api: tuple[Path, Api]) -> None:
    root, record = api
    record.answer = b'{"outcome": "created"}'
    client = ManagementClient(root)
    assert client.call("PUT", "/deployments", json={"document": {"name": "chat"}}) == {"outcome": "created"}
    assert client.call("GET", "/events", params={"after": 3, "limit": 1000, "deployment": None}) == {
        "outcome": "created"
    }
    put, get = record.seen
    token = StateDir(root).read_admin_token()
    assert (put.method, put.path, put.headers["authorization"]) == ("PUT", "/deployments", f"Bearer {token}")
    assert put.headers["content-type"] == "application/json"
    assert json.loads(put.body) == {"document": {"name": "chat"}}
    assert (get.method, get.path, get.body) == ("GET", "/events?after=3&limit=1000", b"")


def test_a_name_that_is_not_a_path_segment_is_quoted_not_refused(api: tuple[Path, Api]) -> None:
    root, record = api
    ManagementClient(root).call("GET", "/deployments/a b?c")
    assert record.seen[0].path == "/deployments/a%20b%3Fc"


def test_an_error_answer_keeps_its_code_message_and_extra_fields(api: tuple[Path, Api]) -> None:
    root, record = api
    record.status = 409
    record.answer = json.dumps(
        {"error": {"code": "host_busy", "message": "it runs chat", "type": "conflict", "host": "gpu-a"}}
    ).encode()
    with pytest.raises(ServerError) as raised:
        ManagementClient(root).call("POST", "/hosts/gpu-a/drain")
    assert (raised.value.code, raised.value.message, raised.value.extra) == (
        "host_busy",
        "it runs chat",
        {"host": "gpu-a"},
    )
    assert record.seen[0].method == "POST"


def test_an_answer_that_is_not_json_is_an_error_with_its_text(api: tuple[Path, Api]) -> None:
    root, record = api
    record.status = 502
    record.answer = b"<html>bad gateway</html>"
    with pytest.raises(ServerError) as raised:
        ManagementClient(root).call("GET", "/hosts")
    assert (raised.value.code, raised.value.message) == ("http_502", "<html>bad gateway</html>")


def test_a_server_that_is_gone_is_server_not_running(tmp_path: Path) -> None:
    state = StateDir(tmp_path / "state")
    state.prepare()
    state.admin_token()
    with socket.socket() as closed:  # a port nothing listens on any more
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    state.write_management(f"http://127.0.0.1:{port}")
    with pytest.raises(ServerNotRunning, match="cannot reach the CapyCTL management API"):
        ManagementClient(state.root).call("GET", "/hosts")


def test_a_state_directory_without_a_server_says_how_to_start_one(tmp_path: Path) -> None:
    with pytest.raises(ServerNotRunning, match="capyctl start standalone"):
        ManagementClient(tmp_path / "nothing")
