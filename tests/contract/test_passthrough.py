"""What reaches the engine: the client's fields unchanged, never the caller's ID or CapyCTL's key."""

from __future__ import annotations

import httpx
import msgspec

from tests.contract.conftest import Folder
from tests.integration.harness import CapyServer

Replayed = tuple[CapyServer, dict[str, Folder]]


def engine_saw(folder: Folder) -> dict:
    return httpx.get(folder.url + "/replay/stats", timeout=5).json()


def test_engine_gets_the_body_unchanged_and_no_caller_id_or_key(replayed: Replayed) -> None:
    server, folders = replayed
    folder = folders["vllm-0.32.0"]
    body = {
        "model": "vllm-0.32.0",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": True,
        "cache_salt": "tenant-a",
        "temperature": 0.3,
        "chat_template_kwargs": {"enable_thinking": False},
        "replay_case": "chat_stream_usage",
    }
    r = httpx.post(
        server.base_url + "/v1/chat/completions",
        json=body,
        headers={**server.headers(), "X-Request-Id": "caller-secret-42"},
        timeout=30,
    )
    assert r.status_code == 200 and r.headers["x-request-id"] == "caller-secret-42"
    seen = engine_saw(folder)["last_request"]
    names = {name.lower() for name, _ in seen["headers"]}
    assert "x-request-id" not in names and "authorization" not in names
    assert "caller-secret-42" not in str(seen) and server.api_key not in str(seen)
    sent = msgspec.json.decode(seen["body"])
    assert sent.pop("model") == "vllm-0.32.0"  # the served name (attached: the deployment's model)
    assert sent == {k: v for k, v in body.items() if k != "model"}  # cache_salt and the rest untouched


def test_non_streamed_requests_ask_the_engine_for_a_stream_with_usage(replayed: Replayed) -> None:
    server, folders = replayed
    body = {"model": "sglang-0.5.21", "messages": [{"role": "user", "content": "hi"}], "cache_salt": "t"}
    r = httpx.post(server.base_url + "/v1/chat/completions", json=body, headers=server.headers(), timeout=30)
    assert r.status_code == 200 and r.json()["object"] == "chat.completion"
    sent = msgspec.json.decode(engine_saw(folders["sglang-0.5.21"])["last_request"]["body"])
    assert sent["stream"] is True and sent["stream_options"] == {"include_usage": True}
    assert sent["cache_salt"] == "t"


def test_cache_salt_never_reaches_engines_that_ignore_it(replayed: Replayed) -> None:
    server, folders = replayed
    for name in ("llamacpp-0.6.0", "tensorfold-0.6.3"):
        before = engine_saw(folders[name])["requests"]
        for stream in (False, True):
            r = httpx.post(
                server.base_url + "/v1/chat/completions",
                headers=server.headers(),
                timeout=30,
                json={"model": name, "messages": [], "cache_salt": "tenant-a", "stream": stream},
            )
            if stream:
                assert r.status_code == 200
                assert msgspec.json.decode(r.text.strip()[6:])["error"]["code"] == "cache_salt_unsupported"
            else:
                assert r.status_code == 400 and r.json()["error"]["code"] == "cache_salt_unsupported"
        assert engine_saw(folders[name])["requests"] == before
