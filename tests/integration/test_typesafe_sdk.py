"""The decisions API through a real third-party client, ``typesafe-sdk``, against a real CapyCTL.

The engine is the stand-in as vLLM 0.32 (tests/fakes/standin_engine.py): it
answers decisions in vLLM's exact shape, so the SDK's strict models parse
what CapyCTL relays.
"""

from __future__ import annotations

from collections.abc import Iterator

import msgspec
import pytest
from typesafe_sdk import (
    Choice,
    Noul,
    RetryPolicy,
    Score,
    TypeSafeAuthenticationError,
    TypeSafeBadRequestError,
    TypeSafeClient,
)

from tests.fakes.standin_venv import make_standin_venv
from tests.integration.harness import CapyServer

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CapyServer]:
    tmp = tmp_path_factory.mktemp("sdk")
    (tmp / "model").mkdir()
    capy = CapyServer(tmp / "state").start()
    try:
        capy.cli("engine", "add", str(make_standin_venv(tmp / "vllm-venv", "vllm", "0.32.0")), "--name", "vllm")
        for name, api in (("decider", "decisions"), ("chatty", "chat")):
            path = tmp / f"{name}.yaml"
            path.write_bytes(
                msgspec.yaml.encode({"name": name, "engine": "vllm", "model": str(tmp / "model"), "api": api})
            )
            capy.cli("deploy", "model", "--file", str(path))
        yield capy
    finally:
        capy.stop()


def client(server: CapyServer, model: str = "decider", key: str | None = None) -> TypeSafeClient:
    # the SDK takes the server's root (it adds /v1 itself); no retries, so a refusal shows at once
    return TypeSafeClient(
        api_key=key or server.api_key,
        model=model,
        base_url=server.base_url,
        retry=RetryPolicy(max_retries=0),
        timeout=120,
    )


QUESTIONS = {
    "angry": Noul(instructions="Is the customer angry?"),
    "route": Choice(
        instructions="Which team should handle this?",
        criteria={"billing": "payments and refunds", "shipping": None, "technical": None},
    ),
    "urgency": Score(instructions="How urgent is this?", criteria=["can wait", "this week", "today"]),
}


def test_the_sdk_parses_noul_choice_and_score(server: CapyServer) -> None:
    with client(server) as sdk:
        answer = sdk.system_one("I was charged twice for my order last week.", QUESTIONS)
    assert answer.model == "decider"
    assert 0 <= answer.answers["angry"].noul <= 1
    assert answer.answers["route"].choice in ("billing", "shipping", "technical")
    assert abs(sum(answer.answers["route"].probabilities.values()) - 1) < 1e-6
    assert 0 <= answer.answers["urgency"].score <= 2
    raw = answer.raw_http_response
    assert len(raw.headers["x-capyctl-request-id"]) == 26
    metrics = raw.json()["capyctl"]["metrics"]
    assert metrics["total_ms"]["source"] == "router" and metrics["input_tokens"]["source"] == "engine"


def test_api_mismatch_is_the_sdks_bad_request(server: CapyServer) -> None:
    with client(server, model="chatty") as sdk, pytest.raises(TypeSafeBadRequestError) as caught:
        sdk.system_one("hi", {"angry": QUESTIONS["angry"]})
    assert "POST /v1/chat/completions" in str(caught.value)


def test_a_wrong_key_is_the_sdks_authentication_error(server: CapyServer) -> None:
    with client(server, key="k" * 40) as sdk, pytest.raises(TypeSafeAuthenticationError):
        sdk.system_one("hi", {"angry": QUESTIONS["angry"]})
