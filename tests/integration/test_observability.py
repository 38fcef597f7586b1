"""Request IDs, logs, stored events, cache_salt and CapyCTL's Prometheus endpoint, on the real llama-server."""

import sqlite3
import time

import httpx
import msgspec
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.harness import CapyServer, engine_metric

HELLO = [{"role": "user", "content": "Hello"}]
CALLER = "checkout-7f3a-SECRET"


def chat(served: CapyServer, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(
        served.base_url + "/v1/chat/completions",
        json={"model": "smollm2", "messages": HELLO, **body},
        headers={**served.headers(), **(headers or {})},
        timeout=60,
    )


def test_caller_request_id_is_handed_back_and_logged_but_never_stored(served: CapyServer) -> None:
    plain = chat(served, {"max_tokens": 4}, {"X-Request-Id": CALLER})
    assert plain.status_code == 200 and plain.headers["x-request-id"] == CALLER
    with httpx.stream(
        "POST",
        served.base_url + "/v1/chat/completions",
        timeout=60,
        json={"model": "smollm2", "messages": HELLO, "max_tokens": 4, "stream": True},
        headers={**served.headers(), "X-Request-Id": CALLER + "-s"},
    ) as r:
        assert r.headers["x-request-id"] == CALLER + "-s"
        r.read()
    ours = plain.headers["x-capyctl-request-id"]
    line = next(line for line in served.log().splitlines() if f"request {ours}" in line)
    assert f"request {ours} (caller {CALLER}) smollm2 -> " in line and line.endswith("instance 0 key default")
    # reading the events first makes CapyCTL store what it had queued (its writer batches them)
    events = served.cli("events", "--deployment", "smollm2", "--json").stdout
    assert ours in events and CALLER not in events
    database = served.state_dir / "capyctl.db"
    for path in database.parent.glob("capyctl.db*"):  # the file and its WAL
        assert CALLER.encode() not in path.read_bytes()
    with sqlite3.connect(database) as db:
        details = [row[0] for row in db.execute("SELECT detail FROM events WHERE kind = 'router_selection'")]
    assert any(ours.encode() in bytes(d) for d in details)


def test_bad_caller_request_ids_are_refused_before_anything_wakes(served: CapyServer) -> None:
    for bad in ["", "has space", "x" * 129, "caf\u00e9"]:
        r = httpx.post(
            served.base_url + "/v1/chat/completions",
            headers=[("authorization", f"Bearer {served.api_key}"), ("x-request-id", bad.encode("utf-8"))],
            json={"model": "smollm2", "messages": HELLO},
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", bad
        assert r.json()["error"]["param"] == "X-Request-Id"
    twice = httpx.post(
        served.base_url + "/v1/chat/completions",
        json={"model": "smollm2", "messages": HELLO},
        headers=[("authorization", f"Bearer {served.api_key}"), ("x-request-id", "a"), ("x-request-id", "b")],
    )
    assert twice.status_code == 400 and "more than once" in twice.json()["error"]["message"]


def test_cache_salt_is_refused_for_llama_cpp_and_never_reaches_it(served: CapyServer) -> None:
    port = served.cli_json("status", "deployment", "smollm2")["instances"][0]["port"]
    chat(served, {"max_tokens": 1})  # make sure the engine is up, with this prompt in a slot's cache
    # what one such request costs the engine: the same request again decodes the same number of batches
    start = engine_metric(port, "llamacpp:n_decode_total")
    assert chat(served, {"max_tokens": 1}).status_code == 200
    before = engine_metric(port, "llamacpp:n_decode_total")
    one_request = before - start
    for body in [{"cache_salt": ""}, {"cache_salt": 5}, {"cache_salt": "x" * 1025}, {"cache_salt": "\u00e9" * 513}]:
        r = chat(served, body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", body
        assert r.json()["error"]["param"] == "cache_salt"
    refused = chat(served, {"cache_salt": "tenant-a"})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "cache_salt_unsupported"
    stream = chat(served, {"cache_salt": "tenant-a", "stream": True})
    assert stream.status_code == 200 and stream.headers["content-type"].startswith("text/event-stream")
    event = msgspec.json.decode(stream.text.strip()[len("data: ") :])
    assert event["error"]["code"] == "cache_salt_unsupported"
    # a request sent after them is served, so anything they had sent the engine was sent before it; once the
    # engine is idle it has done all of it, and its decodes are that one request's alone
    assert chat(served, {"max_tokens": 1}).status_code == 200  # the same request without the salt is served
    until_idle = time.monotonic() + 60
    while engine_metric(port, "llamacpp:requests_processing") or engine_metric(port, "llamacpp:requests_deferred"):
        assert time.monotonic() < until_idle, "the engine is still busy: a refused request reached it"
        time.sleep(0.05)
    assert engine_metric(port, "llamacpp:n_decode_total") - before == one_request, (
        "a refused request reached the engine"
    )


def test_prometheus_endpoint_parses_and_counts(served: CapyServer) -> None:
    unauthorised = httpx.get(served.base_url + "/metrics")
    assert unauthorised.status_code == 401
    chat(served, {"max_tokens": 2})
    chat(served, {"messages": "not a list"})
    scrape = httpx.get(served.base_url + "/metrics", headers=served.headers())
    assert scrape.status_code == 200 and scrape.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(scrape.text)}
    requests = {
        (s.labels["deployment"], s.labels["code"]): s.value
        for s in families["capyctl_requests"].samples
        if s.name == "capyctl_requests_total"
    }
    assert requests[("smollm2", "ok")] >= 1
    assert requests[("smollm2", "invalid_request_error")] >= 1
    ttft = [
        s
        for s in families["capyctl_time_to_first_token_seconds"].samples
        if s.name.endswith("_count") and s.labels["deployment"] == "smollm2"
    ]
    assert ttft and ttft[0].value >= 1
    assert any(
        s.labels == {"deployment": "smollm2", "state": "ready"} and s.value == 1
        for s in families["capyctl_deployment_state"].samples
    )
    assert {s.labels["deployment"] for s in families["capyctl_requests_in_flight"].samples} == {"smollm2"}
    assert "capyctl_relay_latency_seconds" in families and "capyctl_engine_restarts" in families


def test_json_logs_carry_both_request_ids(tmp_path, llama) -> None:
    from tests.integration.harness import deployment_file

    server = CapyServer(tmp_path / "state", "--log-format", "json").start()
    try:
        server.cli("engine", "add", str(llama.server), "--name", "llama-server")
        server.cli("deploy", "model", "--file", str(deployment_file(tmp_path, "smollm2", "llama-server", llama.model)))
        ours = chat(server, {"max_tokens": 2}, {"X-Request-Id": CALLER}).headers["x-capyctl-request-id"]
        anonymous = chat(server, {"max_tokens": 2}).headers["x-capyctl-request-id"]
        lines = [msgspec.json.decode(line) for line in server.log().splitlines() if line.startswith("{")]
        assert lines and all("time" in e and "message" in e for e in lines)
        selections = {e["capyctl_request_id"]: e for e in lines if e.get("event") == "router_selection"}
        assert selections[ours]["caller_request_id"] == CALLER
        assert selections[ours]["deployment"] == "smollm2" and selections[ours]["instance"] == 0
        assert selections[anonymous]["caller_request_id"] is None
        assert any(e.get("event") == "state_changed" and e.get("state") == "ready" for e in lines)
    finally:
        server.stop()
