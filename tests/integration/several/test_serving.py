"""Requests served across machines: deployments on two hosts, reached through the server, in network namespaces.

The server places nothing on its own machine here: each deployment names its host, whose engine (a stand-in
vLLM on each host, the real llama-server on one) runs behind the host's ingress. What a client sees is
checked at the server's inference API: chat streamed and not, and a decision, verified and with metrics;
``device_offline`` while a host is silent, and the same engine serving again once it speaks.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from tests.fakes.standin_venv import make_standin_venv
from tests.integration.harness import llama_paths
from tests.integration.machines import INFERENCE_PORT, Machine, hosts, joined, until
from tests.integration.netns import Lan

pytestmark = pytest.mark.integration
DECISION = {"state": "The sky is green.", "questions": {"q": {"type": "noul", "instructions": "Is it true?"}}}


def key_of(server: Machine) -> str:
    return str(json.loads((server.state / "identity" / "server-credentials.json").read_text())["api_key"])


def deploy(server: Machine, tmp: Path, name: str, engine: str, host: str, model: str, **extra: Any) -> None:
    path = tmp / f"{name}.yaml"
    path.write_bytes(msgspec.yaml.encode({"name": name, "engine": engine, "model": model, "host": host, **extra}))
    server.cli("deploy", "model", "--file", str(path), "--activate", "--wait", timeout=180)


def chat(lan: Lan, key: str, model: str, stream: bool, **headers: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "stream": stream}
    return httpx.post(f"http://{lan.server.address}:{INFERENCE_PORT}/v1/chat/completions", json=body, timeout=120,
                      headers={"authorization": f"Bearer {key}", **headers})


def streamed_metrics(text: str) -> dict[str, Any]:
    events = [line for line in text.split("\n\n") if line.strip()]
    assert events[-1] == "data: [DONE]", events[-3:]
    assert events[-2].startswith(": x-capyctl-metrics "), events[-3:]
    return dict(msgspec.json.decode(events[-2][len(": x-capyctl-metrics "):]))


def instance_pid(server: Machine, name: str) -> int | None:
    status = json.loads(server.cli("status", "deployment", name, "--json").stdout)
    return status["instances"][0]["pid"] if status["instances"] else None


@pytest.fixture
def two_hosts(lan: Lan, server: Machine, tmp_path: Path) -> dict[str, Machine]:
    made = {name: joined(lan, server, name, tmp_path) for name in ("gpu-a", "gpu-b")}
    for name in made:
        venv = make_standin_venv(tmp_path / f"vllm-{name}", "vllm", "0.32.0")
        server.cli("engine", "add", str(venv), "--host", name, "--name", "vllm")
    server.cli("engine", "add", str(llama_paths().server), "--host", "gpu-a", "--name", "llama")
    return made


def test_chat_and_decisions_are_served_from_each_host_through_the_server(
        lan: Lan, server: Machine, two_hosts: dict[str, Machine], tmp_path: Path) -> None:
    key = key_of(server)
    deploy(server, tmp_path, "chat-a", "vllm", "gpu-a", str(tmp_path / "model"))
    deploy(server, tmp_path, "decide-b", "vllm", "gpu-b", str(tmp_path / "model"), api="decisions")
    deploy(server, tmp_path, "llama-a", "llama", "gpu-a", str(llama_paths().model),
           engine_config={"context_length": 2048})
    for model in ("chat-a", "llama-a"):
        whole = chat(lan, key, model, stream=False)
        assert whole.status_code == 200, whole.text
        answer = whole.json()
        assert answer["model"] == model and answer["choices"][0]["message"]["content"]
        assert answer["capyctl"]["metrics"]["ttft_ms"]["value"] > 0
        streamed = chat(lan, key, model, stream=True)
        assert streamed.status_code == 200, streamed.text
        assert streamed_metrics(streamed.text)["ttft_ms"]["value"] > 0
    decided = httpx.post(f"http://{lan.server.address}:{INFERENCE_PORT}/v1/systemone", timeout=60,
                         json={"model": "decide-b", **DECISION}, headers={"authorization": f"Bearer {key}"})
    assert decided.status_code == 200, decided.text
    assert set(decided.json()["answers"]) == {"q"}
    # each engine runs on its own host, listening on that host's loopback only
    assert instance_pid(server, "chat-a") in lan.hosts["gpu-a"].pids()
    assert instance_pid(server, "decide-b") in lan.hosts["gpu-b"].pids()


def test_a_silent_host_answers_device_offline_then_serves_again_with_the_same_engine(
        lan: Lan, server: Machine, two_hosts: dict[str, Machine], tmp_path: Path) -> None:
    key = key_of(server)
    deploy(server, tmp_path, "chat-a", "vllm", "gpu-a", str(tmp_path / "model"))
    assert chat(lan, key, "chat-a", stream=False).status_code == 200
    pid = instance_pid(server, "chat-a")
    agent = two_hosts["gpu-a"].process
    assert agent is not None and pid is not None
    agent.send_signal(signal.SIGSTOP)
    try:
        until(lambda: hosts(server)["gpu-a"]["state"] == "suspended", 6, "gpu-a suspended")
        refused = chat(lan, key, "chat-a", stream=False)  # refused at once: nothing waits on the silent host
        assert refused.status_code == 503, refused.text
        error = refused.json()["error"]
        assert error["code"] == "device_offline" and error["model"] == "chat-a" and error["reason"] == "suspended"
        assert int(refused.headers["retry-after"]) > 0
        streamed = chat(lan, key, "chat-a", stream=True)
        assert streamed.status_code == 503 and streamed.json()["error"]["code"] == "device_offline"
    finally:
        agent.send_signal(signal.SIGCONT)
    until(lambda: chat(lan, key, "chat-a", stream=False).status_code == 200, 10, "chat-a served again")
    assert instance_pid(server, "chat-a") == pid  # the same engine: nothing was started again
