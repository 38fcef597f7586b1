"""Settlement on the real llama-server: cut requests stay counted until the engine proves it dropped them."""

from __future__ import annotations

import socket
import time

import httpx
import msgspec
import pytest

from tests.integration.harness import CapyServer, engine_metric

pytestmark = pytest.mark.integration


def unsettled(server: CapyServer) -> list[dict]:
    return server.cli_json("status", "deployment", "smollm2")["instances"][0]["unsettled"]


def events(server: CapyServer, kind: str) -> list[dict]:
    lines = server.cli("events", "--deployment", "smollm2", "--json").stdout.splitlines()
    return [e for e in map(msgspec.json.decode, lines) if e["kind"] == kind]


def open_stream(server: CapyServer, body: dict) -> socket.socket:
    data = msgspec.json.encode({"model": "smollm2", "stream": True, **body})
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.api_key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
        + data
    )
    return sock


def until(condition, limit: float = 30.0) -> None:
    deadline = time.monotonic() + limit
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert condition()


def test_a_stream_cut_after_its_first_text_is_counted_then_settled_by_the_engines_idle_report(
    served: CapyServer,
) -> None:
    cuts_before = len(events(served, "request_cut"))
    sock = open_stream(served, {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 2000})
    received = b""
    sock.settimeout(30)
    while received.count(b'"content":"') < 2:  # text has come (not only the role chunk)
        received += sock.recv(65536)
    sock.close()
    until(lambda: len(events(served, "request_cut")) == cuts_before + 1)
    assert events(served, "request_cut")[-1]["detail"]["rule"] == "engine_idle"
    until(lambda: unsettled(served) == [])
    settled = events(served, "request_settled")[-1]["detail"]
    assert settled["rule"] == "engine_idle" and settled["seconds"] >= 0


def test_a_request_cut_before_any_output_stays_counted_until_the_engine_stops(served: CapyServer) -> None:
    port = served.cli_json("status", "deployment", "smollm2")["instances"][0]["port"]
    prompt = (
        "Summarise this text. " + "The capybara is the largest living rodent. " * 150
    )  # a long prefill, within a slot's 2048 tokens
    sock = open_stream(served, {"messages": [{"role": "user", "content": prompt}], "max_tokens": 8})
    until(lambda: engine_metric(port, "llamacpp:requests_processing") >= 1, 30)  # the engine has it
    sock.close()  # before any output: the engine may still be on its prompt
    until(lambda: unsettled(served) == [{"rule": "engine_stop", "count": 1}])
    scrape = httpx.get(served.base_url + "/metrics", headers=served.headers(), timeout=10).text
    assert 'capyctl_requests_unsettled{deployment="smollm2",rule="engine_stop"} 1.0' in scrape
    until(lambda: engine_metric(port, "llamacpp:requests_processing") == 0, 60)  # the engine is idle again...
    assert unsettled(served) == [{"rule": "engine_stop", "count": 1}]  # ...and that does not settle it
    text = served.cli("status", "deployment", "smollm2").stdout
    assert "engine_stop" in text and "next stop or restart" in text
    served.cli("stop", "deployment", "smollm2")
    assert unsettled(served) == []
    assert events(served, "request_settled")[-1]["detail"]["rule"] == "engine_stop"
    served.cli("start", "deployment", "smollm2", "--wait")
