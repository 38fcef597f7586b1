"""Chat through CapyCTL's HTTP surface against the real llama-server and SmolLM2."""

import re
import socket
import time

import httpx
import msgspec
import openai
import pytest

from tests.integration.harness import CapyServer, engine_metric

ULID = re.compile(r"^[0-9A-HJKMNP-TV-Z]{26}$")
HELLO = [{"role": "user", "content": "Hello"}]


def chat(served: CapyServer, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(
        served.base_url + "/v1/chat/completions", json=body, headers=served.headers(**headers), timeout=60
    )


def sse_events(text: str) -> list[str]:
    return [block for block in text.split("\n\n") if block]


def test_non_streamed_chat_is_assembled_from_the_engine_stream(served: CapyServer) -> None:
    response = chat(served, {"model": "smollm2", "messages": HELLO, "max_tokens": 24})
    assert response.status_code == 200, response.text
    assert response.headers["cache-control"] == "no-store"
    assert ULID.match(response.headers["x-capyctl-request-id"])
    answer = response.json()
    assert answer["object"] == "chat.completion"
    assert answer["model"] == "smollm2"  # the engine calls it after its file; the relay rewrites it
    choice = answer["choices"][0]
    assert choice["message"]["role"] == "assistant"
    assert isinstance(choice["message"]["content"], str) and choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length")
    # usage was asked of the engine for the client, and llama.cpp's own timings pass through
    assert answer["usage"]["completion_tokens"] <= 24 and answer["usage"]["prompt_tokens"] > 0
    assert answer["timings"]["predicted_n"] == answer["usage"]["completion_tokens"]
    assert answer["system_fingerprint"] == "b0-unknown"
    metrics = answer["capyctl"]["metrics"]
    timings = answer["timings"]
    assert metrics["prefill_ms"] == {"value": round(timings["prompt_ms"], 2), "source": "engine"}
    assert metrics["decode_tokens_per_second"] == {
        "value": round(timings["predicted_per_second"], 2),
        "source": "engine",
    }
    assert metrics["ttft_ms"]["source"] == "router" and 0 < metrics["ttft_ms"]["value"] < 60_000
    assert metrics["cached_tokens"] == {
        "value": answer["usage"]["prompt_tokens_details"]["cached_tokens"],
        "source": "engine",
    }
    assert "queue_ms" not in metrics  # llama.cpp does not measure it: absent, never 0


def test_streamed_chat_relays_engine_chunks_with_model_rewritten(served: CapyServer) -> None:
    body = {"model": "smollm2", "messages": HELLO, "max_tokens": 12, "stream": True}
    with httpx.stream(
        "POST", served.base_url + "/v1/chat/completions", json=body, headers=served.headers(), timeout=60
    ) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert ULID.match(r.headers["x-capyctl-request-id"])
        text = r.read().decode()
    events = sse_events(text)
    assert events[-1] == "data: [DONE]"
    assert events[-2].startswith(": x-capyctl-metrics ")  # one comment line just before [DONE]
    metrics = msgspec.json.decode(events[-2][len(": x-capyctl-metrics ") :])
    assert metrics["ttft_ms"]["source"] == "router" and metrics["ttft_ms"]["value"] > 0
    assert metrics["prefill_ms"]["source"] == "engine"  # llama.cpp's timings.prompt_ms
    chunks = [msgspec.json.decode(e[len("data: ") :]) for e in events[:-2]]
    assert all(c["model"] == "smollm2" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert "timings" in chunks[-1]  # llama.cpp's own object, untouched
    # no usage chunk: the client did not ask for one (stream_options stay the client's)
    assert all("usage" not in c for c in chunks)


def test_streamed_usage_only_when_the_client_asks(served: CapyServer) -> None:
    body = {
        "model": "smollm2",
        "messages": HELLO,
        "max_tokens": 5,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream(
        "POST", served.base_url + "/v1/chat/completions", json=body, headers=served.headers(), timeout=60
    ) as r:
        events = sse_events(r.read().decode())
    usage = msgspec.json.decode(events[-3][len("data: ") :])
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5


def test_openai_client_works_streamed_and_not(served: CapyServer) -> None:
    client = openai.OpenAI(base_url=served.base_url + "/v1", api_key=served.api_key)
    reply = client.chat.completions.create(model="smollm2", messages=HELLO, max_tokens=16)
    assert reply.model == "smollm2" and reply.choices[0].message.content
    pieces = [
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(model="smollm2", messages=HELLO, max_tokens=16, stream=True)
        if chunk.choices
    ]
    assert "".join(pieces)
    assert [m.id for m in client.models.list().data] == ["smollm2"]


def test_missing_and_wrong_key_are_401_with_request_ids(served: CapyServer) -> None:
    url = served.base_url + "/v1/chat/completions"
    body = {"model": "smollm2", "messages": HELLO}
    missing = httpx.post(url, json=body)
    wrong = httpx.post(url, json=body, headers={"authorization": "Bearer nope"})
    assert (missing.status_code, missing.json()["error"]["code"]) == (401, "missing_api_key")
    assert (wrong.status_code, wrong.json()["error"]["code"]) == (401, "invalid_api_key")
    ids = {missing.headers["x-capyctl-request-id"], wrong.headers["x-capyctl-request-id"]}
    assert len(ids) == 2 and all(ULID.match(i) for i in ids)
    models = httpx.get(served.base_url + "/v1/models")
    assert (models.status_code, models.json()["error"]["code"]) == (401, "missing_api_key")
    models = httpx.get(served.base_url + "/v1/models", headers={"authorization": "Bearer nope"})
    assert (models.status_code, models.json()["error"]["code"]) == (401, "invalid_api_key")


def test_invalid_json_names_the_reason(served: CapyServer) -> None:
    r = httpx.post(
        served.base_url + "/v1/chat/completions",
        content=b'{"model": "smollm2", nope}',
        headers=served.headers(**{"content-type": "application/json"}),
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["code"] == "invalid_json" and error["type"] == "invalid_request_error"
    assert "byte 21" in error["reason"]  # msgspec says where the body went wrong
    assert ULID.match(r.headers["x-capyctl-request-id"])


def test_unknown_model_lists_what_is_available(served: CapyServer) -> None:
    r = chat(served, {"model": "gpt-9", "messages": HELLO})
    assert r.status_code == 404
    error = r.json()["error"]
    assert (error["code"], error["model"], error["available"]) == ("model_not_found", "gpt-9", ["smollm2"])
    assert ULID.match(r.headers["x-capyctl-request-id"])


def test_refused_and_malformed_fields(served: CapyServer) -> None:
    for body, param in [
        ({"messages": HELLO}, "model"),
        ({"model": "smollm2", "messages": HELLO, "stream": "yes"}, "stream"),
        ({"model": "smollm2", "messages": HELLO, "return_hidden_states": True}, "return_hidden_states"),
    ]:
        r = chat(served, body)
        assert r.status_code == 400, body
        assert r.json()["error"]["code"] == "invalid_request" and r.json()["error"]["param"] == param
    r = httpx.post(served.base_url + "/v1/chat/completions", content=b"[1, 2]", headers=served.headers())
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request"


def test_a_body_over_32_mib_is_413(served: CapyServer) -> None:
    big = b'{"model": "smollm2", "messages": [], "pad": "' + b"x" * (32 * 1024 * 1024) + b'"}'
    r = httpx.post(served.base_url + "/v1/chat/completions", content=big, headers=served.headers(), timeout=60)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "too_large"
    assert ULID.match(r.headers["x-capyctl-request-id"])


def test_engine_errors_are_relayed_with_their_status(served: CapyServer) -> None:
    r = chat(served, {"model": "smollm2", "messages": "not a list"})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["type"] == error["code"] == "invalid_request_error"
    assert "messages" in error["message"]


def test_unknown_paths_get_the_error_envelope(served: CapyServer) -> None:
    r = httpx.get(served.base_url + "/v1/nothing", headers=served.headers())
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"


def _engine_port(served: CapyServer) -> int:
    return served.cli_json("status", "deployment", "smollm2")["instances"][0]["port"]


def _wait_metric(port: int, name: str, want: float, within: float) -> float | None:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if engine_metric(port, name) == want:
            return time.monotonic()
        time.sleep(0.02)
    return None


@pytest.mark.parametrize("stream", [False, True])
def test_client_hang_up_stops_the_engine(served: CapyServer, stream: bool) -> None:
    """llama.cpp alone runs a non-streamed request on after its client left; through CapyCTL it stops."""
    port = _engine_port(served)
    body = msgspec.json.encode(
        {
            "model": "smollm2",
            "stream": stream,
            "max_tokens": 1500,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "Count from 1 to 1000."}],
        }
    )
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {served.api_key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    sock = socket.create_connection(("127.0.0.1", served.port))
    try:
        sock.sendall(request)
        assert _wait_metric(port, "llamacpp:requests_processing", 1, within=10), "the engine never started the request"
        time.sleep(0.3)  # let it generate for a while
    finally:
        sock.close()
    hung_up = time.monotonic()
    stopped = _wait_metric(port, "llamacpp:requests_processing", 0, within=1.0)
    assert stopped is not None, "the engine still works on the request 1 s after the client hung up"
    assert stopped - hung_up < 1.0
