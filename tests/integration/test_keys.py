"""Named API keys through a real CapyCTL: the CLI, the HTTP surface, replay engines standing in for vLLM,
SGLang and llama.cpp, restarts, and a state directory written before named keys."""

from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from openai import OpenAI

from capyctl.domain.keys import split_key
from tests.integration.harness import CapyServer

ROOT = Path(__file__).parents[2]
RECORDINGS = ROOT / "tests" / "contract" / "recordings"
OLD_STATE = ROOT / "tests" / "fixtures" / "state-before-named-keys"
_LISTENING = re.compile(r"listening on (http://\S+)")
DECISION = {
    "model": "vdec",
    "state": "The sky is green.",
    "questions": {"q": {"type": "noul", "instructions": "Is it true?"}},
}


class Replay:
    def __init__(self, folder: str, *args: str) -> None:
        self.process = subprocess.Popen(
            [sys.executable, "-m", "capyctl.replay", "--recordings", str(RECORDINGS / folder), "--port", "0", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        assert self.process.stdout is not None
        line = self.process.stdout.readline().decode()
        match = _LISTENING.search(line)
        assert match, f"replay engine on {folder} did not start: {line}"
        self.url = match.group(1)

    def stats(self) -> dict[str, Any]:
        return httpx.get(self.url + "/replay/stats", timeout=5).json()

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(10)


@pytest.fixture(scope="module")
def engines() -> Iterator[dict[str, Replay]]:
    started: dict[str, Replay] = {}
    try:
        started["vllm"] = Replay("vllm/0.32.0", "--default-case", "chat_stream_usage")
        started["llamacpp"] = Replay("llamacpp/0.6.0", "--default-case", "chat_stream_usage")
        started["sglang"] = Replay("sglang/0.5.22", "--default-case", "chat_stream_usage")
        yield started
    finally:
        for replay in started.values():
            replay.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, engines: dict[str, Replay]) -> Iterator[CapyServer]:
    """One CapyCTL with chat on vLLM (vchat) and llama.cpp (lchat), decisions on vLLM (vdec) and SGLang (sdec)."""
    tmp = tmp_path_factory.mktemp("keys")
    capy = CapyServer(tmp / "state").start()
    try:
        for name, family, version, api in [
            ("vchat", "vllm", "0.32.0", "chat"),
            ("lchat", "llamacpp", "0.6.0", "chat"),
            ("vdec", "vllm", "0.32.0", "decisions"),
            ("sdec", "sglang", "0.5.22", "decisions"),
        ]:
            path = tmp / f"{name}.yaml"
            path.write_bytes(
                msgspec.yaml.encode(
                    {
                        "name": name,
                        "engine": family,
                        "endpoint": engines[family].url,
                        "engine_version": version,
                        "api": api,
                    }
                )
            )
            capy.cli("deploy", "model", "--file", str(path), "--wait")
        yield capy
    finally:
        capy.stop()


def chat(server: CapyServer, key: str, model: str = "vchat", **extra: Any) -> httpx.Response:
    return httpx.post(
        server.base_url + "/v1/chat/completions",
        headers={"authorization": f"Bearer {key}"},
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], **extra},
        timeout=30,
    )


def models(server: CapyServer, key: str) -> httpx.Response:
    return httpx.get(server.base_url + "/v1/models", headers={"authorization": f"Bearer {key}"}, timeout=10)


def create(server: CapyServer, name: str, *options: str) -> str:
    done = server.cli("create", "key", name, *options)
    secret = done.stdout.strip()
    assert re.fullmatch(r"capy_[a-z2-7]{10}_[A-Za-z0-9_-]{43}", secret), done.stdout
    assert f"key {name} created" in done.stderr and secret not in done.stderr
    return secret


def secret_part(key: str) -> str:
    """The secret of a named key, all 43 characters of it (they may include '_', as base64url does)."""
    parts = split_key(key)
    assert parts is not None, "not a named key"
    return parts[1]


def code(response: httpx.Response) -> str:
    return response.json()["error"]["code"]


def seconds_to_midnight_utc() -> float:
    return 86400 - time.time() % 86400


def test_create_list_and_revoke_through_the_cli_and_the_next_request_is_refused(server: CapyServer) -> None:
    secret = create(server, "app1", "--daily-limit", "50")
    assert chat(server, secret).status_code == 200
    listed = {k["name"]: k for k in server.cli_json("list", "keys")}
    assert set(listed) >= {"default", "app1"}
    app1 = listed["app1"]
    assert (app1["daily_limit"], app1["used_today"], app1["models"], app1["cache_salt"]) == (50, 1, None, False)
    assert app1["last_used"] is not None and "secret" not in app1
    table = server.cli("list", "keys").stdout
    assert "app1" in table and "default" in table and secret not in table
    assert secret_part(secret) not in str(listed)

    again = server.cli("create", "key", "app1", "--json", check=False)
    assert again.returncode == 5 and msgspec.json.decode(again.stdout)["error"]["code"] == "already_exists"
    assert chat(server, secret).status_code == 200  # the refused creation changed nothing

    assert server.cli("revoke", "key", "app1").stdout.strip() == "key app1 revoked"
    refused = chat(server, secret)
    assert refused.status_code == 401 and code(refused) == "invalid_api_key"
    assert models(server, secret).status_code == 401
    gone = server.cli("revoke", "key", "app1", check=False)
    assert gone.returncode == 4 and "key_not_found" in gone.stderr
    assert chat(server, server.api_key).status_code == 200  # the others are untouched
    kinds = [e["kind"] for e in map(msgspec.json.decode, server.cli("events", "--json").stdout.splitlines())]
    assert "key_created" in kinds and "key_revoked" in kinds


def test_bad_input_is_refused_clearly_and_creates_nothing(server: CapyServer) -> None:
    for options, param in [
        (["bad name"], "name"),
        (["n1", "--cache-salt", "a/b"], "cache_salt"),
        (["n1", "--models", ","], "models"),
    ]:
        done = server.cli("create", "key", *options, "--json", check=False)
        error = msgspec.json.decode(done.stdout)["error"]
        assert done.returncode == 6 and error["code"] == "invalid_request" and error["param"] == param
    low = server.cli("create", "key", "n1", "--daily-limit", "0", check=False)
    assert low.returncode != 0 and "daily-limit" in low.stderr
    assert "n1" not in {k["name"] for k in server.cli_json("list", "keys")}


def test_the_secret_is_nowhere_in_the_state_directory_the_database_or_the_logs(server: CapyServer) -> None:
    secret = create(server, "hidden")
    assert chat(server, secret).status_code == 200
    assert chat(server, secret, stream=True).status_code == 200
    assert (
        httpx.post(
            server.base_url + "/v1/chat/completions", headers={"authorization": f"Bearer {secret}x"}, json={}
        ).status_code
        == 401
    )
    server.cli("events", "--json")  # the stored events are flushed
    part = secret_part(secret).encode()
    files = [p for p in server.state_dir.rglob("*") if p.is_file()] + [server.log_path]
    assert any(p.name == "capyctl.db" for p in files)
    for path in files:
        data = path.read_bytes()
        assert part not in data and secret.encode() not in data, path
    default = secret_part(server.api_key).encode()
    holding = [
        p.relative_to(server.state_dir)
        for p in server.state_dir.rglob("*")
        if p.is_file() and default in p.read_bytes()
    ]
    assert holding == [Path("identity/credentials")]  # the default key: only in its 0600 file
    for path in (server.state_dir / "identity" / "credentials", server.state_dir / "capyctl.db"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert "key hidden" in server.log()  # the request line names the key, never its secret


def test_a_daily_limit_refuses_with_retry_after_to_midnight_and_survives_a_restart(
    tmp_path: Path, engines: dict[str, Replay]
) -> None:
    capy = CapyServer(tmp_path / "state").start()
    try:
        path = tmp_path / "vchat.yaml"
        path.write_bytes(
            msgspec.yaml.encode(
                {"name": "vchat", "engine": "vllm", "endpoint": engines["vllm"].url, "engine_version": "0.32.0"}
            )
        )
        capy.cli("deploy", "model", "--file", str(path), "--wait")
        secret = create(capy, "capped", "--daily-limit", "3")
        for _ in range(4):
            assert models(capy, secret).status_code == 200  # listing does not count
        assert code(chat(capy, secret, model="nope")) == "model_not_found"  # refused by CapyCTL: not counted
        assert (
            code(
                httpx.post(
                    capy.base_url + "/v1/chat/completions", content=b"{", headers={"authorization": f"Bearer {secret}"}
                )
            )
            == "invalid_json"
        )
        assert code(chat(capy, secret, cache_salt="")) == "invalid_request"
        assert code(chat(capy, secret, model="vchat", stream="yes")) == "invalid_request"
        for _ in range(3):
            assert chat(capy, secret).status_code == 200
        before = seconds_to_midnight_utc()
        refused = chat(capy, secret)
        after = seconds_to_midnight_utc()
        assert refused.status_code == 429 and code(refused) == "daily_limit"
        error = refused.json()["error"]
        assert (error["limit"], error["used"], error["type"]) == (3, 3, "rate_limit_exceeded")
        assert after - 1 <= int(refused.headers["retry-after"]) <= before + 1
        assert models(capy, secret).status_code == 200  # a key at its limit still lists
        capy.stop()
        capy.start()
        (listed,) = [k for k in capy.cli_json("list", "keys") if k["name"] == "capped"]
        assert listed["used_today"] == 3
        assert code(chat(capy, secret)) == "daily_limit"
        assert chat(capy, capy.api_key).status_code == 200  # another key is not limited by it
    finally:
        capy.stop()


def test_twenty_concurrent_calls_with_ten_left_give_exactly_ten_answers(server: CapyServer) -> None:
    secret = create(server, "burst", "--daily-limit", "15")
    for _ in range(5):
        assert chat(server, secret).status_code == 200
    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        statuses = list(pool.map(lambda _: chat(server, secret, replay_interval_ms=20).status_code, range(20)))
    assert sorted(statuses) == [200] * 10 + [429] * 10
    (listed,) = [k for k in server.cli_json("list", "keys") if k["name"] == "burst"]
    assert listed["used_today"] == 15 and listed["under_way"] == 0


def test_a_scoped_key_sees_and_uses_only_its_models(server: CapyServer) -> None:
    secret = create(server, "scoped", "--models", "vchat,vdec,later")
    assert [m["id"] for m in models(server, secret).json()["data"]] == ["vchat", "vdec"]
    assert {m["id"] for m in models(server, server.api_key).json()["data"]} == {"vchat", "lchat", "vdec", "sdec"}
    assert chat(server, secret).status_code == 200
    for other in ("lchat", "sdec", "nope", "later"):  # later: on its list, not deployed
        refused = chat(server, secret, model=other)
        assert refused.status_code == 404 and code(refused) == "model_not_found"
        error = refused.json()["error"]
        assert error["available"] == ["vchat", "vdec"]
        assert "lchat" not in str(error).replace(f"'{other}'", "") and "sdec" not in str(error).replace(
            f"'{other}'", ""
        )
    metrics = httpx.get(server.base_url + "/metrics", headers={"authorization": f"Bearer {secret}"})
    assert metrics.status_code == 403 and code(metrics) == "forbidden"


def test_a_salted_key_carries_its_salt_to_vllm_and_is_refused_where_it_cannot_be_kept(
    server: CapyServer, engines: dict[str, Replay]
) -> None:
    secret = create(server, "tenant-a", "--cache-salt", "salt-of-tenant-a")
    assert chat(server, secret).status_code == 200
    last = engines["vllm"].stats()["last_request"]
    assert msgspec.json.decode(last["body"])["cache_salt"] == "salt-of-tenant-a"
    assert secret_part(secret) not in str(last)  # the key is never sent to an engine
    assert chat(server, secret, cache_salt="salt-of-tenant-a").status_code == 200
    seen = engines["vllm"].stats()["requests"]
    other = chat(server, secret, cache_salt="salt-of-tenant-b")
    assert other.status_code == 400 and code(other) == "invalid_request"
    assert "salt-of-tenant-a" not in other.text
    assert engines["vllm"].stats()["requests"] == seen

    reached = engines["llamacpp"].stats()["requests"]
    refused = chat(server, secret, model="lchat")
    assert refused.status_code == 400 and code(refused) == "cache_salt_unsupported"
    with httpx.stream(
        "POST",
        server.base_url + "/v1/chat/completions",
        headers={"authorization": f"Bearer {secret}"},
        json={"model": "lchat", "messages": [], "stream": True},
    ) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert stream.status_code == 200 and '"code":"cache_salt_unsupported"' in events[0]
    assert engines["llamacpp"].stats()["requests"] == reached  # the engine saw nothing
    assert chat(server, server.api_key, model="lchat").status_code == 200  # an unsalted key is served there

    decided = engines["vllm"].stats()["decisions"]["requests"]
    headers = {"authorization": f"Bearer {secret}"}
    httpx.post(server.base_url + "/v1/systemone", headers=headers, json=DECISION, timeout=30)
    log = engines["vllm"].stats()["decisions"]
    assert log["requests"] == decided + 1 and secret_part(secret) not in str(log["log"][-1])
    assert msgspec.json.decode(log["log"][-1]["body"])["cache_salt"] == "salt-of-tenant-a"
    sglang = engines["sglang"].stats()["decisions"]["requests"]
    refused = httpx.post(server.base_url + "/v1/systemone", headers=headers, json={**DECISION, "model": "sdec"})
    assert refused.status_code == 400 and code(refused) == "cache_salt_unsupported"
    assert engines["sglang"].stats()["decisions"]["requests"] == sglang
    (listed,) = [k for k in server.cli_json("list", "keys") if k["name"] == "tenant-a"]
    assert listed["cache_salt"] is True and "salt-of-tenant-a" not in server.cli("list", "keys", "--json").stdout


def test_the_key_name_is_in_the_events_the_log_and_the_request_counts(server: CapyServer) -> None:
    secret = create(server, "seen")
    assert chat(server, secret).status_code == 200
    selections = [
        e
        for e in map(msgspec.json.decode, server.cli("events", "--json").stdout.splitlines())
        if e["kind"] == "router_selection" and e["detail"].get("key") == "seen"
    ]
    assert len(selections) == 1
    assert re.search(r"request \w{26} vchat -> \S+ instance 0 key seen", server.log())
    scrape = httpx.get(server.base_url + "/metrics", headers=server.headers()).text
    assert re.search(r'capyctl_requests_total\{[^}]*key="seen"[^}]*\} 1\.0', scrape), scrape


def test_the_openai_client_works_with_a_named_key(server: CapyServer) -> None:
    secret = create(server, "sdk", "--models", "vchat")
    client = OpenAI(base_url=server.base_url + "/v1", api_key=secret, max_retries=0)
    assert [m.id for m in client.models.list()] == ["vchat"]
    reply = client.chat.completions.create(model="vchat", messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model="vchat", messages=[{"role": "user", "content": "hi"}], stream=True
        )
        if c.choices
    )
    assert streamed == reply.choices[0].message.content
    with pytest.raises(Exception) as refused:
        OpenAI(base_url=server.base_url + "/v1", api_key=secret + "x", max_retries=0).models.list()
    assert getattr(refused.value, "status_code", None) == 401


def test_a_state_directory_from_before_named_keys_keeps_its_key(tmp_path: Path) -> None:
    state = tmp_path / "state"
    shutil.copytree(OLD_STATE, state)
    os.chmod(state, 0o700)
    os.chmod(state / "identity", 0o700)
    os.chmod(state / "identity" / "credentials", 0o600)
    old_key = (state / "identity" / "credentials").read_text().split("api_key: ", 1)[1].strip()
    assert old_key.startswith("capy-")
    capy = CapyServer(state).start()
    try:
        assert capy.api_key == old_key  # the file is left as it was: the seed's sed line still reads it
        assert models(capy, old_key).status_code == 200
        assert models(capy, old_key[:-1] + "x").status_code == 401
        (default,) = capy.cli_json("list", "keys")
        assert default["name"] == "default" and default["legacy"] is True
        new = create(capy, "after-upgrade")
        assert models(capy, new).status_code == 200
        capy.stop()
        capy.start()
        assert models(capy, old_key).status_code == 200 and models(capy, new).status_code == 200
        assert old_key.removeprefix("capy-").encode() not in (state / "capyctl.db").read_bytes()
    finally:
        capy.stop()
