"""A deployment whose engine cannot start, and an operator's stop, through the real HTTP surface and CLI."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import msgspec
import pytest

from tests.integration.harness import CapyServer, LlamaPaths, deployment_file

pytestmark = pytest.mark.integration
MESSAGES = [{"role": "user", "content": "Write a long story about a capybara."}]


def started_launches(server: CapyServer, name: str) -> int:
    lines = server.cli("events", "--deployment", name, "--json").stdout.splitlines()  # one JSON object a line
    return sum(1 for line in lines if msgspec.json.decode(line)["kind"] == "engine_started")


def test_an_engine_that_cannot_start_ends_failed_and_answers_llm_unavailable(
    capy: CapyServer, llama: LlamaPaths, tmp_path: Path
) -> None:
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + b"\0" * 64)  # a model file llama-server cannot load: it exits at each start
    capy.cli("engine", "add", str(llama.server), "--name", "llama-server")
    capy.cli("deploy", "model", "--file", str(deployment_file(tmp_path, "broken", "llama-server", broken)))
    r = httpx.post(
        capy.base_url + "/v1/chat/completions",
        headers=capy.headers(),
        timeout=120,
        json={"model": "broken", "messages": MESSAGES, "max_tokens": 4},
    )
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["code"] == "llm-unavailable" and "while starting" in error["reason"]
    assert "capyctl start deployment broken" in error["message"]
    assert capy.cli_json("status", "deployment", "broken")["state"] == "failed"
    launches = started_launches(capy, "broken")
    assert launches == 5
    again = httpx.post(
        capy.base_url + "/v1/chat/completions",
        headers=capy.headers(),
        timeout=30,
        json={"model": "broken", "messages": MESSAGES, "max_tokens": 4, "stream": True},
    )
    assert again.status_code == 502 and again.json()["error"]["code"] == "llm-unavailable"
    assert started_launches(capy, "broken") == launches  # a request does not start a failed deployment


def test_an_engine_that_cannot_be_launched_fails_alone_and_says_why(
    capy: CapyServer, llama: LlamaPaths, tmp_path: Path
) -> None:
    capy.cli("engine", "add", str(llama.server), "--name", "llama-server")
    blocker = capy.state_dir / "logs" / "blocked"  # a file where the deployment's log folder must be made
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("not a folder")
    capy.cli("deploy", "model", "--file", str(deployment_file(tmp_path, "blocked", "llama-server", llama.model)))
    r = httpx.post(
        capy.base_url + "/v1/chat/completions",
        headers=capy.headers(),
        timeout=120,
        json={"model": "blocked", "messages": MESSAGES, "max_tokens": 4},
    )
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["code"] == "llm-unavailable", r.text
    assert error["reason"] == f"could not launch the engine: FileExistsError: [Errno 17] File exists: '{blocker}'"
    status = capy.cli_json("status", "deployment", "blocked")
    assert status["state"] == "failed"
    lines = capy.cli("events", "--deployment", "blocked", "--json").stdout.splitlines()
    kinds = [msgspec.json.decode(line)["kind"] for line in lines]
    assert kinds.count("engine_start_failed") == 5 and "engine_started" not in kinds  # each try counted, none ran
    # CapyCTL itself goes on: another deployment starts and answers beside the failed one
    capy.cli("deploy", "model", "--file", str(deployment_file(tmp_path, "smollm2", "llama-server", llama.model)))
    r = httpx.post(
        capy.base_url + "/v1/chat/completions",
        headers=capy.headers(),
        timeout=120,
        json={"model": "smollm2", "messages": MESSAGES, "max_tokens": 4},
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]


def test_an_operators_stop_cuts_requests_with_deployment_stopped_and_holds(served: CapyServer) -> None:
    got: dict[str, str] = {}

    def long_stream() -> None:
        with httpx.stream(
            "POST",
            served.base_url + "/v1/chat/completions",
            headers=served.headers(),
            timeout=120,
            json={"model": "smollm2", "messages": MESSAGES, "max_tokens": 2000, "stream": True},
        ) as r:
            got["status"] = str(r.status_code)
            got["body"] = "".join(r.iter_text())

    reader = threading.Thread(target=long_stream)
    reader.start()
    try:
        deadline = time.monotonic() + 30
        while "status" not in got and time.monotonic() < deadline:  # the stream has begun
            time.sleep(0.02)
        assert got.get("status") == "200"
        served.cli("stop", "deployment", "smollm2")
    finally:
        reader.join(60)
    last = [e for e in got["body"].split("\n\n") if e][-1]
    assert last.startswith('data: {"error"') and '"code":"deployment_stopped"' in last
    refused = httpx.post(
        served.base_url + "/v1/chat/completions",
        headers=served.headers(),
        timeout=30,
        json={"model": "smollm2", "messages": MESSAGES, "max_tokens": 4},
    )
    assert refused.status_code == 409 and refused.json()["error"]["code"] == "deployment_stopped"
    assert served.cli_json("status", "deployment", "smollm2")["state"] == "stopped"
    served.cli("start", "deployment", "smollm2", "--wait")
