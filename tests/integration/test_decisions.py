"""POST /v1/systemone through a real CapyCTL: the front door, field checks, api_mismatch both ways, refusals.

The real llama-server here has the route but SmolLM2 is no decision model, so
its answer is a refusal (501), relayed as engine_rejected with that status.
Answers from a decision engine: test_typesafe_sdk.py (the stand-in as vLLM), test_vllm_live.py (real
vLLM) and the contract suite (tests/contract/test_decisions.py, from recordings).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import msgspec
import pytest

from tests.integration.harness import CapyServer, LlamaPaths

pytestmark = pytest.mark.integration
QUESTIONS = {"angry": {"type": "noul", "instructions": "Is the customer angry?"}}


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory, llama: LlamaPaths) -> Iterator[CapyServer]:
    """A chat deployment and a decisions deployment, both on llama-server, neither started."""
    tmp = tmp_path_factory.mktemp("decisions")
    server = CapyServer(tmp / "state").start()
    try:
        server.cli("engine", "add", str(llama.server), "--name", "llama-server")
        for name, api in (("chatty", "chat"), ("decider", "decisions")):
            path = tmp / f"{name}.yaml"
            path.write_bytes(
                msgspec.yaml.encode(
                    {
                        "name": name,
                        "engine": "llama-server",
                        "model": str(llama.model),
                        "api": api,
                        "engine_config": {"context_length": 2048},
                    }
                )
            )
            server.cli("deploy", "model", "--file", str(path))
        yield server
    finally:
        server.stop()


def decide(server: CapyServer, body: dict, **headers: str) -> httpx.Response:
    return httpx.post(
        server.base_url + "/v1/systemone", json=body, timeout=120, headers={**server.headers(), **headers}
    )


def state(server: CapyServer, name: str) -> str:
    return server.cli_json("status", "deployment", name)["state"]


def test_api_mismatch_both_ways_starts_nothing(both: CapyServer) -> None:
    r = decide(both, {"model": "chatty", "state": "hi", "questions": QUESTIONS})
    assert r.status_code == 400 and r.json()["error"]["code"] == "api_mismatch"
    assert "send its requests to POST /v1/chat/completions" in r.json()["error"]["message"]
    r = httpx.post(
        both.base_url + "/v1/chat/completions",
        headers=both.headers(),
        timeout=60,
        json={"model": "decider", "messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "api_mismatch"
    assert "send its requests to POST /v1/systemone" in r.json()["error"]["message"]
    assert (state(both, "chatty"), state(both, "decider")) == ("stopped", "stopped")


@pytest.mark.parametrize("field", ["stream", "temperature", "assets"])
def test_a_field_outside_the_api_is_refused_before_anything_starts(both: CapyServer, field: str) -> None:
    r = decide(both, {"model": "decider", "state": "hi", "questions": QUESTIONS, field: True})
    assert r.status_code == 400
    error = r.json()["error"]
    assert (error["code"], error["param"]) == ("invalid_request", field)
    assert len(r.headers["x-capyctl-request-id"]) == 26 and r.headers["cache-control"] == "no-store"
    assert state(both, "decider") == "stopped"


def test_the_engines_refusal_comes_back_as_engine_rejected_with_its_status(both: CapyServer) -> None:
    r = decide(
        both,
        {"model": "decider", "state": "I was charged twice.", "questions": QUESTIONS},
        **{"X-Request-Id": "caller-42"},
    )
    assert r.status_code == 501, r.text  # llama.cpp: not a decision model
    assert r.json()["error"]["code"] == "engine_rejected" and r.json()["error"]["status"] == 501
    assert r.headers["x-request-id"] == "caller-42" and len(r.headers["x-capyctl-request-id"]) == 26
    assert state(both, "decider") == "ready"  # it was started for the request


def test_the_front_door_checks_the_key_and_the_method(both: CapyServer) -> None:
    body = {"model": "decider", "state": "hi", "questions": QUESTIONS}
    assert (
        httpx.post(both.base_url + "/v1/systemone", json=body, timeout=10).json()["error"]["code"] == "missing_api_key"
    )
    r = httpx.get(both.base_url + "/v1/systemone", headers=both.headers(), timeout=10)
    assert r.status_code == 405 and "use POST" in r.json()["error"]["message"]
    anonymous = httpx.get(both.base_url + "/v1/embeddings", timeout=10)
    assert anonymous.status_code == 401  # the key first: a caller without one learns nothing of the paths
    keyed = httpx.get(both.base_url + "/v1/embeddings", headers=both.headers(), timeout=10)
    assert keyed.status_code == 404 and keyed.json()["error"]["code"] == "not_found"
    assert "x-capyctl-request-id" in anonymous.headers and "x-capyctl-request-id" in keyed.headers
