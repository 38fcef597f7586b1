"""Request records through the real surfaces: chat requests relayed by a real CapyCTL from a replay engine
(vLLM 0.32.0's captured stream: its usage and metrics), refusals, then ``capyctl list requests`` and the
management API's ``/requests``. The caller's X-Request-Id is in neither, nor in the database's bytes."""

from __future__ import annotations

import re
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from tests.integration.harness import CapyServer, replay_behind_capyctl

RECORDING = Path(__file__).parents[1] / "contract" / "recordings" / "vllm" / "0.32.0"
CALLER = "caller-7f3a-SECRET"
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CapyServer]:
    with replay_behind_capyctl(
        tmp_path_factory.mktemp("records"), RECORDING, "--default-case", "chat_stream_usage"
    ) as capy:
        yield capy


def chat(server: CapyServer, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    return httpx.post(
        server.base_url + "/v1/chat/completions",
        timeout=30,
        json={"model": "chat", "messages": HELLO, **body},
        headers=headers or server.headers(),
    )


def management(server: CapyServer, path: str, **params: Any) -> httpx.Response:
    token = (server.state_dir / "identity" / "admin-token").read_text().strip()
    return httpx.get(
        f"http://127.0.0.1:{server.management_port}{path}",
        params=params,
        timeout=30,
        headers={"authorization": f"Bearer {token}"},
    )


def by_id(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {row["id"]: row for row in rows}


def test_answers_streamed_or_not_and_refusals_are_recorded_without_the_callers_id(server: CapyServer) -> None:
    plain = chat(server, server.headers(**{"X-Request-Id": CALLER}))
    assert plain.status_code == 200, plain.text
    with httpx.stream(
        "POST",
        server.base_url + "/v1/chat/completions",
        timeout=30,
        json={"model": "chat", "messages": HELLO, "stream": True},
        headers=server.headers(**{"X-Request-Id": CALLER + "-s"}),
    ) as streamed:
        relayed = streamed.read()
        assert streamed.status_code == 200 and b"data: [DONE]" in relayed
    unknown = chat(server, server.headers(**{"X-Request-Id": CALLER + "-u"}), model="nope")
    assert unknown.status_code == 404
    bad_key = chat(server, {"authorization": "Bearer not-a-key", "X-Request-Id": CALLER + "-k"})
    assert bad_key.status_code == 401
    bad_caller = chat(server, server.headers(**{"X-Request-Id": "has space"}))
    assert bad_caller.status_code == 400

    listed = server.cli("list", "requests", "--json").stdout
    assert CALLER not in listed
    rows = by_id(msgspec.json.decode(listed))
    answer = rows[plain.headers["x-capyctl-request-id"]]
    assert {k: answer[k] for k in ("api", "code", "status", "deployment", "key", "instance", "stream")} == {
        "api": "chat",
        "code": "ok",
        "status": 200,
        "deployment": "chat",
        "key": "default",
        "instance": 0,
        "stream": False,
    }
    metrics = plain.json()["capyctl"]["metrics"]  # the row says what the answer said
    assert answer["ttft_ms"] == metrics["ttft_ms"]["value"] and answer["ttft_ms"] > 0
    assert answer["queue_ms"] == metrics["queue_ms"]["value"]
    assert answer["decode_tokens_per_second"] == metrics["decode_tokens_per_second"]["value"]
    assert (answer["prompt_tokens"], answer["completion_tokens"]) == (37, 200)  # the recording's usage
    assert answer["cached_tokens"] is None  # the engine did not report it: left out, never 0
    assert answer["queue_wait_ms"] is not None and answer["queue_wait_ms"] >= 0 and answer["total_ms"] > 0
    assert answer["cause"] is None and answer["settlement"] is None

    stream = rows[streamed.headers["x-capyctl-request-id"]]
    assert (stream["code"], stream["status"], stream["stream"], stream["deployment"]) == ("ok", 200, True, "chat")
    assert stream["ttft_ms"] is not None and stream["ttft_ms"] > 0
    line = re.search(rb"^: x-capyctl-metrics (.*)$", relayed, re.M)  # the stream's own metrics line
    assert line is not None
    said = msgspec.json.decode(line.group(1))
    assert stream["ttft_ms"] == said["ttft_ms"]["value"]
    assert stream["decode_tokens_per_second"] == said["decode_tokens_per_second"]["value"]
    assert (stream["prompt_tokens"], stream["completion_tokens"]) == (37, 200)  # the stream's usage chunk

    refused = rows[unknown.headers["x-capyctl-request-id"]]
    assert (refused["code"], refused["status"], refused["deployment"], refused["key"], refused["instance"]) == (
        "model_not_found",
        404,
        "nope",
        "default",
        None,
    )
    assert rows[bad_key.headers["x-capyctl-request-id"]]["code"] == "invalid_api_key"
    assert rows[bad_key.headers["x-capyctl-request-id"]]["key"] is None
    assert rows[bad_caller.headers["x-capyctl-request-id"]]["status"] == 400

    one = management(server, "/requests/" + plain.headers["x-capyctl-request-id"])
    assert one.status_code == 200 and one.json() == answer
    for path in server.state_dir.glob("capyctl.db*"):  # the database and its WAL
        assert CALLER.encode() not in path.read_bytes(), path.name


def test_a_stream_the_client_left_is_recorded_cut_then_settled(server: CapyServer) -> None:
    """The client hangs up after the first text: the row says so (cause, and the engine_idle rule, since the
    engine had answered), and once the engine reports itself idle, after how long it was settled."""
    with httpx.stream(
        "POST",
        server.base_url + "/v1/chat/completions",
        timeout=30,
        headers=server.headers(),
        json={"model": "chat", "messages": HELLO, "stream": True, "replay_interval_ms": 50},
    ) as r:
        ours = r.headers["x-capyctl-request-id"]
        for line in r.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                break  # the first text came: leave (10 s of stream were still to come)
    deadline = time.monotonic() + 20
    while True:
        row = management(server, "/requests/" + ours)
        if row.status_code == 200 and row.json()["settled_s"] is not None:
            break
        assert time.monotonic() < deadline, row.text
        time.sleep(0.1)
    got = row.json()
    assert (got["code"], got["status"], got["stream"], got["cause"], got["settlement"]) == (
        "client_gone",
        200,
        True,
        "client_gone",
        "engine_idle",
    )
    assert got["ttft_ms"] is None and got["settled_s"] >= 0  # (its answer never ended: no figures)
    assert got["total_ms"] < 5000


def test_an_engine_refusal_before_a_stream_is_recorded_with_the_status_answered(server: CapyServer) -> None:
    """vLLM refuses the request (400, its own error type as the code) before any stream began: the row says
    the status and code the client got, though CapyCTL's error table does not know that code."""
    refused = chat(server, stream=True, replay_case="chat_context_overflow")
    assert refused.status_code == 400, refused.text
    code = refused.json()["error"]["code"]
    row = management(server, "/requests/" + refused.headers["x-capyctl-request-id"]).json()
    assert (row["status"], row["code"], row["stream"], row["deployment"]) == (400, code, True, "chat")


def test_a_refusal_at_the_daily_limit_is_recorded_with_its_key_and_model(server: CapyServer) -> None:
    """The daily limit refuses at the front door, after the key and the model were read: the row names both."""
    secret = server.cli("create", "key", "one-a-day", "--daily-limit", "1").stdout.strip()
    headers = {"authorization": f"Bearer {secret}"}
    assert chat(server, headers).status_code == 200
    refused = chat(server, headers)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "daily_limit"
    row = management(server, "/requests/" + refused.headers["x-capyctl-request-id"]).json()
    assert (row["code"], row["status"], row["key"], row["deployment"], row["instance"]) == (
        "daily_limit",
        429,
        "one-a-day",
        "chat",
        None,
    )
    bad = chat(server, headers, model=7)  # refused before any model was read: the key alone is named
    row = management(server, "/requests/" + bad.headers["x-capyctl-request-id"]).json()
    assert (row["status"], row["key"], row["deployment"]) == (400, "one-a-day", None)


def test_filters_on_the_cli_and_the_api(server: CapyServer) -> None:
    assert chat(server).status_code == 200
    assert chat(server, model="missing").status_code == 404
    only_chat = server.cli_json("list", "requests", "--deployment", "chat", "--since", "10m")
    assert only_chat and {r["deployment"] for r in only_chat} == {"chat"}
    refusals = server.cli_json("list", "requests", "--code", "model_not_found")
    assert refusals and {r["code"] for r in refusals} == {"model_not_found"}
    assert [r["at"] for r in only_chat] == sorted((r["at"] for r in only_chat), reverse=True)  # newest first
    not_found = management(server, "/requests", status=404, limit=1).json()
    assert len(not_found) == 1 and not_found[0]["deployment"] == "missing"
    assert management(server, "/requests", key="nobody").json() == []
    text = server.cli("list", "requests", "--deployment", "missing").stdout
    assert text.splitlines()[0].split()[:6] == ["TIME", "ID", "KEY", "DEPLOYMENT", "STATUS", "CODE"]
    assert "model_not_found" in text and " ok " not in text


@pytest.mark.parametrize(
    ("params", "param"),
    [
        ({"status": "abc"}, "status"),
        ({"limit": 0}, "limit"),
        ({"since": "yesterday"}, "since"),
        ({"model": "chat"}, "model"),
    ],
)
def test_bad_filters_are_400_naming_the_parameter(server: CapyServer, params: dict[str, Any], param: str) -> None:
    r = management(server, "/requests", **params)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"
    assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"]


def test_an_unknown_id_is_404_and_the_records_need_the_admin_token(server: CapyServer) -> None:
    r = management(server, "/requests/01UNKNOWN")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    anonymous = httpx.get(f"http://127.0.0.1:{server.management_port}/requests", timeout=10)
    assert anonymous.status_code == 401
    wrong = httpx.get(
        f"http://127.0.0.1:{server.management_port}/requests",
        timeout=10,
        headers={"authorization": f"Bearer {server.api_key}"},
    )  # an inference key is not the admin's
    assert wrong.status_code == 401


def test_the_cli_reports_a_bad_filter_in_json_too(server: CapyServer) -> None:
    done = server.cli("list", "requests", "--since", "yesterday", "--json", check=False)
    assert done.returncode == 6
    error = msgspec.json.decode(done.stdout)["error"]
    assert error["code"] == "invalid_request" and error["param"] == "since"
    assert "error [invalid_request]" in done.stderr


def test_a_locked_database_delays_no_request_and_the_records_carry_on_once_it_is_free(server: CapyServer) -> None:
    """Another process holds the database's write lock until CapyCTL's write of the records gives up (SQLite's
    busy timeout, 5 s): the chat requests made meanwhile are answered as fast as ever; then the lock goes, and
    the next request is recorded."""
    lock = sqlite3.connect(server.state_dir / "capyctl.db", timeout=0, isolation_level=None)
    lock.execute("BEGIN EXCLUSIVE")
    slowest, answered = 0.0, 0
    try:
        deadline = time.monotonic() + 30
        while not re.search(r"could not store \d+ request records", server.log()):
            assert time.monotonic() < deadline, "the records' write never gave up on the locked database"
            began = time.perf_counter()
            assert chat(server).status_code == 200
            slowest, answered = max(slowest, time.perf_counter() - began), answered + 1
    finally:
        lock.execute("ROLLBACK")
        lock.close()
    assert answered >= 10 and slowest < 1.0, (answered, slowest)
    after = chat(server)
    assert after.headers["x-capyctl-request-id"] in by_id(server.cli_json("list", "requests", "--limit", "5"))


def test_config_check_shows_the_records_settings(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("records:\n  max_count: 500\n  max_age: 36h\n")
    done = subprocess.run(
        [sys.executable, "-m", "capyctl", "config", "check", str(path), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert msgspec.json.decode(done.stdout)["records"] == {"max_count": 500, "max_age_s": 129600.0, "buffer": 10000}
    path.write_text("records:\n  max_count: 0\n")
    done = subprocess.run(
        [sys.executable, "-m", "capyctl", "config", "check", str(path), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 6 and "records.max_count" in msgspec.json.decode(done.stdout)["error"]["message"]
