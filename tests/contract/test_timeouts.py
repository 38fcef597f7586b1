"""CAN-1: an answer that does not begin in time, or goes silent, is cut and the engine told to stop."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import msgspec
import pytest

from tests.contract.conftest import RECORDINGS, Folder, _start_replay
from tests.integration.harness import CapyServer


@pytest.fixture(scope="module")
def strict(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CapyServer, Folder]]:
    """A CapyCTL with a 3 s request deadline and a 1 s stream idle timeout, before a vLLM replay engine."""
    tmp = tmp_path_factory.mktemp("timeouts")
    folder = Folder("vllm", "0.32.0", RECORDINGS / "vllm" / "0.32.0", {})
    server = CapyServer(tmp / "state", "--request-deadline", "3s", "--stream-idle-timeout", "1s")
    try:
        _start_replay(folder)
        server.start()
        path = tmp / "d.yaml"
        path.write_bytes(msgspec.yaml.encode(
            {"name": "slow", "engine": "vllm", "endpoint": folder.url, "engine_version": "0.32.0"}))
        server.cli("deploy", "model", "--file", str(path))
        yield server, folder
    finally:
        server.stop()
        if folder.process is not None:
            folder.process.terminate()
            folder.process.wait(10)


def ask(server: CapyServer, interval_ms: int, stream: bool) -> tuple[httpx.Response, float]:
    began = time.monotonic()
    r = httpx.post(server.base_url + "/v1/chat/completions", headers=server.headers(), timeout=30, json={
        "model": "slow", "messages": [], "stream": stream, "replay_case": "chat_stream_usage",
        "replay_interval_ms": interval_ms})
    return r, time.monotonic() - began


def disconnected(folder: Folder) -> int:
    return httpx.get(folder.url + "/replay/stats", timeout=5).json()["disconnected"]


@pytest.mark.parametrize("stream", [False, True])
def test_no_answer_within_the_deadline_is_504_and_stops_the_engine(
    strict: tuple[CapyServer, Folder], stream: bool
) -> None:
    server, folder = strict
    before = disconnected(folder)
    r, took = ask(server, 4000, stream)  # the engine's first event would come after 4 s
    assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"
    assert 3.0 <= took < 4.0
    assert disconnected(folder) == before + 1


def test_a_silent_stream_is_cut_with_an_error_event(strict: tuple[CapyServer, Folder]) -> None:
    server, folder = strict
    before = disconnected(folder)
    r, took = ask(server, 1500, True)  # role chunk at 1.5 s, text at 3 s, then 1.5 s silences
    assert r.status_code == 200
    events = [e for e in r.text.split("\n\n") if e]
    assert len(events) >= 2  # what had come was relayed
    error = msgspec.json.decode(events[-1][len("data: "):])["error"]
    assert error["code"] == "stream_idle_timeout"
    assert took < 6.0
    assert disconnected(folder) == before + 1
