"""CAN-1: an answer that does not begin in time, or goes silent, is cut and the engine told to stop.

Each check has a server of its own so that no two limits can land on the same
instant: one with a 3 s request deadline (the engine's first event is due after
4 s), one with a 1 s idle timeout and a 30 s deadline (the engine's events come
2 s apart). The engine's count of disconnected clients is polled, with a bound.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import msgspec
import pytest

from tests.contract.conftest import RECORDINGS, Folder, _start_replay
from tests.integration.harness import CapyServer

Bench = tuple[dict[str, CapyServer], Folder]


@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bench]:
    """Two CapyCTLs before one vLLM replay engine: `deadline` (3 s) and `idle` (1 s idle, 30 s deadline)."""
    tmp = tmp_path_factory.mktemp("timeouts")
    folder = Folder("vllm", "0.32.0", RECORDINGS / "vllm" / "0.32.0", {})
    servers = {
        "deadline": CapyServer(tmp / "deadline", "--request-deadline", "3s"),
        "idle": CapyServer(tmp / "idle", "--request-deadline", "30s", "--stream-idle-timeout", "1s"),
    }
    try:
        _start_replay(folder)
        for role, server in servers.items():
            server.start()
            path = tmp / f"{role}.yaml"
            path.write_bytes(
                msgspec.yaml.encode(
                    {"name": "slow", "engine": "vllm", "endpoint": folder.url, "engine_version": "0.32.0"}
                )
            )
            server.cli("deploy", "model", "--file", str(path))
        yield servers, folder
    finally:
        for server in servers.values():
            server.stop()
        if folder.process is not None:
            folder.process.terminate()
            folder.process.wait(10)


def ask(server: CapyServer, interval_ms: int, stream: bool) -> tuple[httpx.Response, float]:
    began = time.monotonic()
    r = httpx.post(
        server.base_url + "/v1/chat/completions",
        headers=server.headers(),
        timeout=60,
        json={
            "model": "slow",
            "messages": [],
            "stream": stream,
            "replay_case": "chat_stream_usage",
            "replay_interval_ms": interval_ms,
        },
    )
    return r, time.monotonic() - began


def disconnected(folder: Folder) -> int:
    return httpx.get(folder.url + "/replay/stats", timeout=5).json()["disconnected"]


def wait_disconnected(folder: Folder, count: int, limit: float = 5.0) -> int:
    deadline = time.monotonic() + limit
    while (seen := disconnected(folder)) < count and time.monotonic() < deadline:
        time.sleep(0.02)
    return seen


@pytest.mark.parametrize("stream", [False, True])
def test_no_answer_within_the_deadline_is_504_and_stops_the_engine(strict: Bench, stream: bool) -> None:
    servers, folder = strict
    before = disconnected(folder)
    r, took = ask(servers["deadline"], 4000, stream)  # the engine's first event would come after 4 s
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
    assert 3.0 <= took < 4.0
    assert wait_disconnected(folder, before + 1) == before + 1


def test_a_silent_stream_is_cut_with_an_error_event(strict: Bench) -> None:
    servers, folder = strict
    before = disconnected(folder)
    r, took = ask(servers["idle"], 2000, True)  # role chunk at 2 s, text at 4 s, then 2 s silences
    assert r.status_code == 200
    events = [e for e in r.text.split("\n\n") if e]
    assert len(events) >= 2  # what had come was relayed
    error = msgspec.json.decode(events[-1][len("data: ") :])["error"]
    assert error["code"] == "stream_idle_timeout"
    assert took < 8.0
    assert wait_disconnected(folder, before + 1) == before + 1
