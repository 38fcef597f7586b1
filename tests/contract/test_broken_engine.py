"""A broken engine, relayed by a real CapyCTL: what cannot be relayed faithfully is an error, never a leak.

The engine is ``tests/fakes/broken_engine.py``, a raw-asyncio HTTP/1.1
server that misbehaves on request (``broken_case``). CapyCTL serves it as
the attached deployment ``broken``. For every broken answer the client gets
an ``edge_error`` (a 502, or a stream whose last event is that error) with
nothing of the broken part relayed, and CapyCTL closes its engine
connection: it pools connections only after complete, valid answers, so
the engine's ``open`` and ``held`` gauges must return to 0.

Each test that checks the gauges starts from an engine with nothing open
(``clean``): a connection an earlier test left behind is closed by
restarting CapyCTL, so that a test fails only for what it did itself.
Healthy ``ok`` answers (whose connection CapyCTL keeps) are checked last.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.fakes.broken_engine import MALFORMED, BrokenEngine
from tests.integration.harness import CapyServer

ULID = re.compile(r"^[0-9A-HJKMNP-TV-Z]{26}$")
BROKEN = [*MALFORMED, "html_200", "empty_200", "json_200", "no_done", "no_done_close", "huge_event"]
STREAMS = pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
MiB = 1024 * 1024
MESSAGES = [{"role": "user", "content": "Hello"}]
# What the engine's valid chunks say (role, then the words): anything else relayed before an error is broken.
VALID_DELTAS = [{"role": "assistant", "content": ""}, {"content": "Hello"}, {"content": " there"}, {"content": "!"}]


def settled(stats: dict[str, Any]) -> bool:
    return stats["open"] == 0 and stats["held"] == 0


def attach(server: CapyServer, tmp: Path, url: str, name: str = "broken") -> None:
    """Deploy the broken engine as an attached vLLM 0.32.0 (declared, so no version probe is needed)."""
    path = tmp / f"{name}-{server.port}.yaml"
    path.write_bytes(msgspec.yaml.encode({"name": name, "engine": "vllm", "endpoint": url, "engine_version": "0.32.0"}))
    server.cli("deploy", "model", "--file", str(path))


@dataclass
class Bench:
    """The broken engine and the CapyCTL processes in front of it, by role (``main``, ``deadline``)."""

    engine: BrokenEngine
    tmp: Path
    servers: dict[str, CapyServer] = field(default_factory=dict)

    def server(self, role: str = "main", *args: str) -> CapyServer:
        """The CapyCTL of ``role``, started (with ``args``) and given the deployment on first use."""
        if role not in self.servers:
            server = self.servers[role] = CapyServer(self.tmp / f"state-{role}", *args).start()
            attach(server, self.tmp, self.engine.url)
        return self.servers[role]

    def restart(self) -> None:
        """Stop every CapyCTL (closing whatever it held open) and start it again on the same state."""
        for role, old in list(self.servers.items()):
            old.stop()
            self.servers[role] = CapyServer(old.state_dir, *old.extra_args).start()

    def stop(self) -> None:
        for server in self.servers.values():
            server.stop()
        self.engine.stop()

    def chat(self, case: str, stream: bool, role: str = "main", **fields: Any) -> httpx.Response:
        server = self.servers[role]
        body = {"model": "broken", "messages": MESSAGES, "stream": stream, "broken_case": case, **fields}
        return httpx.post(server.base_url + "/v1/chat/completions", json=body, headers=server.headers(), timeout=30)

    def wait_settled(self, why: str) -> dict[str, Any]:
        stats = self.engine.wait_for(settled)
        assert settled(stats), f"{why}: the engine still has connections {stats}"
        return stats


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bench]:
    bench = Bench(BrokenEngine(), tmp_path_factory.mktemp("broken"))
    try:
        bench.engine.start()
        bench.server()
        yield bench
    finally:
        bench.stop()


@pytest.fixture
def clean(bench: Bench) -> Bench:
    """The bench with no engine connection open, so that the test sees only its own."""
    if not settled(bench.engine.wait_for(settled, timeout=2.0)):
        bench.restart()
        bench.wait_settled("after CapyCTL restarted (a fault of the broken engine)")
    return bench


# -- reading answers -----------------------------------------------------------------------------------
def sse_events(text: str) -> list[str]:
    return [block for block in text.split("\n\n") if block]


def data_of(event: str) -> Any:
    """An event's decoded data; its raw text when that is not JSON (a broken event relayed)."""
    assert event.startswith("data: "), f"not a data event: {event[:200]!r}"
    try:
        return msgspec.json.decode(event[len("data: ") :])
    except msgspec.DecodeError:
        return event


def delta_of(chunk: Any) -> Any:
    """The first choice's delta; the whole chunk when it has none (a broken chunk relayed)."""
    try:
        return chunk["choices"][0]["delta"]
    except (KeyError, IndexError, TypeError):
        return chunk


def memory_kib(server: CapyServer) -> tuple[int, int]:
    """CapyCTL's resident memory now and at its peak (VmRSS, VmHWM), in KiB."""
    assert server.process is not None
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines())
    return int(fields["VmRSS"].split()[0]), int(fields["VmHWM"].split()[0])


def check_request_id(r: httpx.Response) -> None:
    assert ULID.match(r.headers.get("x-capyctl-request-id", "")), f"no request id in {dict(r.headers)}"


def check_edge_error_answer(r: httpx.Response) -> None:
    """A 502 JSON envelope with code and type ``edge_error``, and no partial answer."""
    assert r.status_code == 502, f"expected 502, got {r.status_code}: {r.text[:300]}"
    assert r.headers.get("cache-control") == "no-store"
    body = r.json()
    assert "choices" not in body, f"a partial answer was sent: {r.text[:300]}"
    error = body["error"]
    assert (error["code"], error["type"]) == ("edge_error", "edge_error"), error
    assert isinstance(error["message"], str) and error["message"]


def check_error_stream(r: httpx.Response, case: str) -> None:
    """A stream whose last event is an ``edge_error``, with no [DONE], no metrics and nothing broken before."""
    assert r.headers["content-type"].startswith("text/event-stream")
    assert len(r.content) < MiB, f"{len(r.content)} bytes relayed"
    events = sse_events(r.text)
    assert events, "the stream ended without an error event"
    assert "data: [DONE]" not in events, f"a broken stream ended as if complete: {events[-2:]}"
    assert not any(line.startswith(": x-capyctl-metrics") for line in r.text.splitlines()), "metrics of a broken stream"
    last = data_of(events[-1])
    error = last.get("error") if isinstance(last, dict) else None
    assert isinstance(error, dict) and error.get("code") == "edge_error", f"last event: {events[-1][:300]}"
    assert isinstance(error.get("message"), str) and error["message"]
    relayed = [data_of(event) for event in events[:-1] if event.startswith("data: ")]
    deltas = [delta_of(chunk) for chunk in relayed]
    if case in MALFORMED:
        assert deltas == VALID_DELTAS[:1], f"expected only the role chunk before the error: {relayed}"
    else:
        assert all(delta in VALID_DELTAS for delta in deltas), f"something broken was relayed: {relayed}"


def requests_total(server: CapyServer) -> dict[str, float]:
    """``capyctl_requests_total`` of the ``broken`` deployment, by code."""
    text = httpx.get(server.base_url + "/metrics", headers=server.headers(), timeout=5).text
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "capyctl_requests_total" and sample.labels.get("deployment") == "broken":
                counts[sample.labels["code"]] = sample.value
    return counts


def raw_chat(server: CapyServer, body: dict[str, Any]) -> bytes:
    payload = msgspec.json.encode(body)
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{server.port}\r\n"
        f"Authorization: Bearer {server.api_key}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode() + payload


def wait_for(bench: Bench, done: Callable[[dict[str, Any]], bool], why: str) -> dict[str, Any]:
    stats = bench.engine.wait_for(done)
    assert done(stats), f"{why}: {stats}"
    return stats


# -- answers CapyCTL cannot relay ----------------------------------------------------------------------
@STREAMS
@pytest.mark.parametrize("case", BROKEN)
def test_an_answer_that_cannot_be_relayed_is_an_edge_error_and_closes_its_connection(
    clean: Bench, case: str, stream: bool
) -> None:
    server = clean.servers["main"]
    rss, peak = memory_kib(server)
    r = clean.chat(case, stream)
    check_request_id(r)
    if stream and r.status_code == 200:
        check_error_stream(r, case)
    else:
        check_edge_error_answer(r)
    rss_after, peak_after = memory_kib(server)
    assert (rss_after - rss) * 1024 < 64 * MiB and (peak_after - peak) * 1024 < 64 * MiB, (
        f"CapyCTL's memory grew: RSS {rss} -> {rss_after} KiB, peak {peak} -> {peak_after} KiB"
    )
    clean.wait_settled(f"after the broken answer {case!r}")


@STREAMS
def test_a_connection_closed_before_the_headers_is_a_502(clean: Bench, stream: bool) -> None:
    r = clean.chat("close_before_headers", stream)
    check_request_id(r)
    assert r.status_code == 502, f"{r.status_code}: {r.text[:300]}"
    assert r.json()["error"]["code"] in ("engine_unavailable", "edge_error")
    clean.wait_settled("after the engine closed before its headers")


# -- an engine that never sends its headers ------------------------------------------------------------
@STREAMS
def test_a_client_that_hangs_up_before_the_headers_closes_the_engine_connection(clean: Bench, stream: bool) -> None:
    server = clean.servers["main"]
    before = clean.engine.stats()["closed_by_peer"]
    body = {"model": "broken", "messages": MESSAGES, "stream": stream, "broken_case": "hold_headers"}
    with socket.create_connection(("127.0.0.1", server.port), timeout=5) as client:
        client.sendall(raw_chat(server, body))
        wait_for(clean, lambda s: s["held"] == 1, "the engine never got the held request")
    stats = clean.engine.wait_for(settled)
    assert settled(stats), f"a request cut before the engine sent its headers kept its engine connection open: {stats}"
    assert stats["closed_by_peer"] == before + 1


@STREAMS
def test_the_request_deadline_cuts_an_engine_that_never_answers(clean: Bench, stream: bool) -> None:
    clean.server("deadline", "--request-deadline", "2s")
    r = clean.chat("hold_headers", stream, role="deadline")
    check_request_id(r)
    assert r.status_code == 504, f"{r.status_code}: {r.text[:300]}"
    assert r.json()["error"]["code"] == "deadline_exceeded"
    clean.wait_settled("after the request deadline cut a held request")


# -- the engine's own errors ---------------------------------------------------------------------------
@STREAMS
def test_an_engine_error_keeps_its_code_message_and_param(bench: Bench, stream: bool) -> None:
    r = bench.chat("error_with_code", stream)
    check_request_id(r)
    assert r.status_code == 400, f"{r.status_code}: {r.text[:300]}"
    error = r.json()["error"]
    assert error["code"] == "context_length_exceeded", error
    assert error["type"] == "context_length_exceeded", error
    assert error["message"] == "This model's maximum context length is 4096 tokens"
    assert error["param"] == "messages"


def test_a_midstream_engine_error_is_relayed_and_ends_the_stream(bench: Bench) -> None:
    r = bench.chat("midstream_error", True)
    check_request_id(r)
    assert r.status_code == 200, f"{r.status_code}: {r.text[:300]}"
    events = sse_events(r.text)
    assert not any(line.startswith(": x-capyctl-metrics") for line in r.text.splitlines()), (
        f"metrics of a failed stream: {events[-3:]}"
    )
    failed_at = [i for i, event in enumerate(events) if event.startswith('data: {"error"')]
    assert len(failed_at) == 1, f"expected the engine's one error event: {events}"
    assert data_of(events[failed_at[0]])["error"]["code"] == "engine_overloaded"
    rest = events[failed_at[0] + 1 :]  # the engine's own [DONE] may follow its error, nothing else
    assert rest in ([], ["data: [DONE]"]), f"the stream went on after the engine's error: {rest}"


def test_a_midstream_engine_error_fails_a_whole_answer_with_its_code(bench: Bench) -> None:
    r = bench.chat("midstream_error", False)
    check_request_id(r)
    assert r.status_code >= 500, f"{r.status_code}: {r.text[:300]}"
    assert r.json()["error"]["code"] == "engine_overloaded"


@STREAMS
def test_a_midstream_engine_error_is_counted_under_its_code(bench: Bench, stream: bool) -> None:
    server = bench.servers["main"]
    before = requests_total(server)
    bench.chat("midstream_error", stream)
    after = requests_total(server)
    assert after.get("engine_overloaded", 0) == before.get("engine_overloaded", 0) + 1, (before, after)
    assert after.get("ok", 0) == before.get("ok", 0), f"a failed answer was counted as ok: {before} -> {after}"


# -- last: healthy answers, whose connection CapyCTL keeps for the next request -----------------------
@STREAMS
def test_a_healthy_answer_is_relayed_whole(bench: Bench, stream: bool) -> None:
    r = bench.chat("ok", stream)
    check_request_id(r)
    assert r.status_code == 200, f"{r.status_code}: {r.text[:300]}"
    if not stream:
        answer = r.json()
        assert answer["choices"][0]["message"]["content"] == "Hello there!"
        assert answer["choices"][0]["finish_reason"] == "stop"
        assert answer["usage"]["completion_tokens"] == 3
        return
    events = sse_events(r.text)
    assert events[-1] == "data: [DONE]" and events[-2].startswith(": x-capyctl-metrics ")
    deltas = [delta_of(data_of(event)) for event in events[:-2]]
    assert deltas == [*VALID_DELTAS, {"content": ""}]
