"""Requests served across machines: deployments on two hosts, reached through the server, in network namespaces.

The server places nothing on its own machine here: each deployment names its host, whose engine (a stand-in
vLLM on each host, the real llama-server on one) runs behind the host's ingress. What a client sees is
checked at the server's inference API: chat streamed and not, and a decision, verified and with metrics;
``device_offline`` while a host is silent, and the same engine serving again once it speaks.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from tests.fakes.standin_engine import read_timeline
from tests.fakes.standin_venv import make_standin_venv
from tests.integration.harness import llama_paths
from tests.integration.machines import CONTROL_PORT, INFERENCE_PORT, Machine, _listed, hosts, joined, until
from tests.integration.netns import Lan
from tests.integration.test_docs import page_blocks

pytestmark = pytest.mark.integration
DECISION = {"state": "The sky is green.", "questions": {"q": {"type": "noul", "instructions": "Is it true?"}}}


def key_of(server: Machine) -> str:
    return str(json.loads((server.state / "identity" / "server-credentials.json").read_text())["api_key"])


def deploy(
    server: Machine, tmp: Path, name: str, engine: str, host: str | None, model: str, check: bool = True, **extra: Any
) -> subprocess.CompletedProcess[str]:
    path = tmp / f"{name}.yaml"
    named = {"host": host} if host is not None else {}
    path.write_bytes(msgspec.yaml.encode({"name": name, "engine": engine, "model": model, **named, **extra}))
    return server.cli("deploy", "model", "--file", str(path), "--activate", "--wait", timeout=180, check=check)


def chat(lan: Lan, key: str, model: str, stream: bool, **headers: str) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8, "stream": stream}
    return httpx.post(
        f"http://{lan.server.address}:{INFERENCE_PORT}/v1/chat/completions",
        json=body,
        timeout=120,
        headers={"authorization": f"Bearer {key}", **headers},
    )


def streamed_metrics(text: str) -> dict[str, Any]:
    events = [line for line in text.split("\n\n") if line.strip()]
    assert events[-1] == "data: [DONE]", events[-3:]
    assert events[-2].startswith(": x-capyctl-metrics "), events[-3:]
    return dict(msgspec.json.decode(events[-2][len(": x-capyctl-metrics ") :]))


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
    lan: Lan, server: Machine, two_hosts: dict[str, Machine], tmp_path: Path
) -> None:
    key = key_of(server)
    for host in ("a", "b"):
        deploy(server, tmp_path, f"chat-{host}", "vllm", f"gpu-{host}", str(tmp_path / "model"))
        deploy(server, tmp_path, f"decide-{host}", "vllm", f"gpu-{host}", str(tmp_path / "model"), api="decisions")
    # the deployment file of docs/several-machines.md, on gpu-a with the real llama-server
    documented = next(b for b in page_blocks("several-machines.md") if b.mark == "host")  # the llama.cpp one
    text = documented.text.replace(f"host: {documented.expect}", "host: gpu-a")
    text = re.sub(r"(?m)^model: .*$", f"model: {llama_paths().model}", text)
    (tmp_path / "documented.yaml").write_text(text)
    server.cli("deploy", "model", "--file", str(tmp_path / "documented.yaml"), "--activate", "--wait", timeout=180)
    llama = str(msgspec.yaml.decode(text)["name"])
    shown = json.loads(server.cli("status", "deployment", llama, "--json").stdout)
    assert shown["host"] == "gpu-a" and shown["engine_family"] == "llamacpp"
    # no host named: both hosts have the engine and are online, so the first by name
    deploy(server, tmp_path, "placed", "vllm", None, str(tmp_path / "model"))
    assert json.loads(server.cli("status", "deployment", "placed", "--json").stdout)["host"] == "gpu-a"
    unknown = deploy(server, tmp_path, "nowhere", "vllm", "gpu-q", "/m", check=False)
    assert unknown.returncode != 0 and "error [host_not_found]" in unknown.stderr
    missing = deploy(server, tmp_path, "no-engine", "llama", "gpu-b", "/m", check=False)
    assert missing.returncode != 0 and "error [engine_not_found]" in missing.stderr and "gpu-b" in missing.stderr
    for model in ("chat-a", "chat-b", llama):
        whole = chat(lan, key, model, stream=False)
        assert whole.status_code == 200, whole.text
        answer = whole.json()
        assert answer["model"] == model and answer["choices"][0]["message"]["content"]
        assert answer["capyctl"]["metrics"]["ttft_ms"]["value"] > 0
        streamed = chat(lan, key, model, stream=True)
        assert streamed.status_code == 200, streamed.text
        assert streamed_metrics(streamed.text)["ttft_ms"]["value"] > 0
    for model in ("decide-a", "decide-b"):
        decided = httpx.post(
            f"http://{lan.server.address}:{INFERENCE_PORT}/v1/systemone",
            timeout=60,
            json={"model": model, **DECISION},
            headers={"authorization": f"Bearer {key}"},
        )
        assert decided.status_code == 200, decided.text
        assert set(decided.json()["answers"]) == {"q"}
    # each engine runs on its own host, listening on that host's loopback only
    for host in ("a", "b"):
        assert instance_pid(server, f"chat-{host}") in lan.hosts[f"gpu-{host}"].pids()
        assert instance_pid(server, f"decide-{host}") in lan.hosts[f"gpu-{host}"].pids()
    listed = hosts(server)
    assert sorted(listed["gpu-a"]["instances"]) == sorted(["chat-a", "decide-a", llama, "placed"])
    assert sorted(listed["gpu-b"]["instances"]) == ["chat-b", "decide-b"]
    # the server's log names the host each request went to
    assert re.search(r"request \w+ chat-b -> gpu-b instance 0", server.read_log())


def test_a_silent_host_answers_device_offline_then_serves_again_with_the_same_engine(
    lan: Lan, server: Machine, two_hosts: dict[str, Machine], tmp_path: Path
) -> None:
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

    two_hosts["gpu-a"].node.link_down()  # longer than lost_after (4 s here)
    try:
        until(lambda: hosts(server)["gpu-a"]["state"] == "lost", 10, "gpu-a lost")
        lost = chat(lan, key, "chat-a", stream=False)
        assert lost.status_code == 503 and lost.json()["error"]["reason"] == "lost"
        held = json.loads(server.cli("status", "deployment", "chat-a", "--json").stdout)
        assert held["state"] == "ready" and held["instances"][0]["pid"] == pid  # held until the host says
        # its engine cannot be told to stop now: refused at once, rather than a command waiting for the host
        for command in (("stop", "deployment", "chat-a"), ("delete", "deployment", "chat-a")):
            refused_now = server.cli(*command, check=False)
            assert refused_now.returncode != 0 and "error [device_offline]" in refused_now.stderr, refused_now.stderr
    finally:
        two_hosts["gpu-a"].node.link_up()
    until(lambda: chat(lan, key, "chat-a", stream=False).status_code == 200, 30, "chat-a served once gpu-a is back")
    assert instance_pid(server, "chat-a") == pid and pid in lan.hosts["gpu-a"].pids()

    server.cli("revoke", "host", "gpu-a")
    revoked = chat(lan, key, "chat-a", stream=False)  # refused at once
    assert revoked.status_code == 503 and revoked.json()["error"]["reason"] == "revoked"
    until(lambda: pid not in lan.hosts["gpu-a"].pids(), 15, "the revoked host's engine ended with its agent")


def test_a_restarted_server_adopts_the_engines_its_hosts_still_run(
    lan: Lan, server: Machine, two_hosts: dict[str, Machine], tmp_path: Path
) -> None:
    key = key_of(server)
    deploy(server, tmp_path, "chat-a", "vllm", "gpu-a", str(tmp_path / "model"))
    deploy(server, tmp_path, "chat-b", "vllm", "gpu-b", str(tmp_path / "model"))
    pids = {name: instance_pid(server, name) for name in ("chat-a", "chat-b")}
    assert server.process is not None
    server.process.send_signal(signal.SIGTERM)
    server.process.wait(30)
    for name, host in (("chat-a", "gpu-a"), ("chat-b", "gpu-b")):
        assert pids[name] in lan.hosts[host].pids()  # the server's stop left the engines on hosts running
    server.start(
        "server", "--listen", f"{lan.server.address}:{INFERENCE_PORT}", "--control-listen", f"0.0.0.0:{CONTROL_PORT}"
    )
    until(
        lambda: _listed(server, "gpu-a") == "online" and _listed(server, "gpu-b") == "online",
        40,
        "both hosts linked to the restarted server",
    )
    for name in ("chat-a", "chat-b"):  # taken over as their hosts link, before any request asks
        until(lambda: instance_pid(server, name) == pids[name], 20, f"{name} adopted")  # noqa: B023
    for name in ("chat-a", "chat-b"):
        answered = chat(lan, key, name, stream=True)
        assert answered.status_code == 200, answered.text
        assert instance_pid(server, name) == pids[name]  # adopted: the same process serves, nothing reloaded
    assert "engine_adopted" in server.cli("events").stdout


def test_what_reaches_a_host_and_what_a_hang_up_does_there(
    lan: Lan, server: Machine, two_hosts: dict[str, Machine], tmp_path: Path
) -> None:
    key = key_of(server)
    timeline = tmp_path / "timeline.jsonl"
    deploy(
        server,
        tmp_path,
        "chat-a",
        "vllm",
        "gpu-a",
        str(tmp_path / "model"),
        engine_config={
            "env": {"STANDIN_TIMELINE": str(timeline), "STANDIN_HEADS": "1", "STANDIN_TOKEN_DELAY_MS": "100"}
        },
    )

    def received() -> list[dict[str, Any]]:
        return [line for line in read_timeline(timeline) if line["event"] == "received"]

    answered = chat(lan, key, "chat-a", stream=False, **{"x-request-id": "caller-7"})
    assert answered.status_code == 200 and answered.headers["x-request-id"] == "caller-7"
    heads = received()
    assert len(heads) == 1 and heads[0]["path"] == "/v1/chat/completions"
    # neither the caller's ID, nor its key, nor the gate key go past the host's ingress
    assert not {"x-request-id", "authorization", "x-capyctl-gate"} & set(heads[0]["headers"])

    big = b'{"model": "chat-a", "messages": [{"role": "user", "content": "' + b"x" * (8 << 20) + b'"}]}'
    refused = httpx.post(
        f"http://{lan.server.address}:{INFERENCE_PORT}/v1/chat/completions",
        content=big,
        headers={"authorization": f"Bearer {key}", "content-type": "application/json"},
        timeout=60,
    )
    assert refused.status_code == 413 and refused.json()["error"]["code"] == "too_large"
    assert len(received()) == 1  # refused at the server's door: the host saw nothing of it

    body = {"model": "chat-a", "messages": [{"role": "user", "content": "Count."}], "max_tokens": 100, "stream": True}
    with httpx.stream(
        "POST",
        f"http://{lan.server.address}:{INFERENCE_PORT}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=60,
    ) as streamed:
        assert streamed.status_code == 200
        for line in streamed.iter_lines():  # the first token came: hang up mid-stream
            if '"content":"' in line.replace(" ", "") and '"content":""' not in line.replace(" ", ""):
                break
    until(
        lambda: any(line["event"] == "client_gone" for line in read_timeline(timeline)),
        10,
        "the engine on gpu-a told that its client left",
    )
    until(
        lambda: "request_settled" in server.cli("events", "--deployment", "chat-a").stdout,
        10,
        "the cut request settled by the host's load readings",
    )
    assert "rule=engine_idle" in server.cli("events", "--deployment", "chat-a").stdout


def test_memory_on_a_hosts_device_is_charged_there_and_models_switch_per_device(
    lan: Lan, server: Machine, tmp_path: Path
) -> None:
    device = "memory:\n  devices:\n    - name: gpu0\n      capacity: 10GiB\n"
    for name in ("gpu-a", "gpu-b"):
        joined(lan, server, name, tmp_path, config=device)
        venv = make_standin_venv(tmp_path / f"vllm-{name}", "vllm", "0.32.0")
        server.cli("engine", "add", str(venv), "--host", name, "--name", "vllm")
    key = key_of(server)
    sized = {"residency": "host_backed", "resources": {"memory": "6GiB", "parked_memory": "1GiB"}}
    deploy(server, tmp_path, "one-a", "vllm", "gpu-a", str(tmp_path / "model"), **sized)
    deploy(server, tmp_path, "one-b", "vllm", "gpu-b", str(tmp_path / "model"), **sized)
    wrong = deploy(
        server, tmp_path, "bad", "vllm", "gpu-a", "/m", check=False, resources={"memory": "1GiB", "device": "gpu9"}
    )
    assert wrong.returncode != 0 and "gpu9" in wrong.stderr and "gpu0" in wrong.stderr

    def shown(name: str) -> dict[str, Any]:
        return dict(json.loads(server.cli("status", "deployment", name, "--json").stdout))

    assert shown("one-a")["memory"]["device"] == "gpu-a/gpu0"
    assert shown("one-a")["memory"]["charged_bytes"] == 6 << 30
    # a second 6 GiB model on gpu-a's 10 GiB: one-a is parked (through its host) to make room
    deploy(server, tmp_path, "two-a", "vllm", "gpu-a", str(tmp_path / "model"), **sized)
    until(lambda: shown("one-a")["state"] == "parked", 30, "one-a parked for two-a")
    assert shown("one-a")["memory"]["charged_bytes"] == 1 << 30
    assert shown("one-b")["state"] == "ready"  # gpu-b's device of the same name is another device
    listed = {d["name"]: d for d in json.loads(server.cli("list", "devices", "--json").stdout)}
    assert listed["gpu-a/gpu0"]["capacity_bytes"] == 10 << 30 and "gpu-b/gpu0" in listed
    assert listed["gpu-a/gpu0"]["charged_bytes"] == (6 << 30) + (1 << 30)  # two-a awake, one-a parked
    (gpu0,) = hosts(server)["gpu-a"]["devices"]
    assert (gpu0["name"], gpu0["charged_bytes"]) == ("gpu0", (6 << 30) + (1 << 30))
    assert "gpu0 7.00 GiB of 10.00 GiB" in server.cli("list", "hosts").stdout
    # a request for the parked model wakes it, through its host, parking two-a in turn
    woken = chat(lan, key, "one-a", stream=False)
    assert woken.status_code == 200, woken.text
    assert shown("one-a")["state"] == "ready" and shown("two-a")["state"] == "parked"
    # no host named: of the two hosts with the engine, the one whose device has room for it now (gpu-a has 3 GiB
    # free, gpu-b 4 GiB), though gpu-a comes first by name
    deploy(server, tmp_path, "roomy", "vllm", None, str(tmp_path / "model"), resources={"memory": "4GiB"})
    assert shown("roomy")["host"] == "gpu-b" and shown("roomy")["state"] == "ready"


def test_a_stream_from_a_host_that_is_lost_ends_with_an_error_event(
    lan: Lan, server: Machine, two_hosts: dict[str, Machine], tmp_path: Path
) -> None:
    key = key_of(server)
    deploy(
        server,
        tmp_path,
        "slow-a",
        "vllm",
        "gpu-a",
        str(tmp_path / "model"),
        engine_config={"env": {"STANDIN_TOKEN_DELAY_MS": "200"}},
    )
    body = {"model": "slow-a", "messages": [{"role": "user", "content": "Count."}], "max_tokens": 200, "stream": True}
    with httpx.stream(
        "POST",
        f"http://{lan.server.address}:{INFERENCE_PORT}/v1/chat/completions",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=60,
    ) as streamed:
        assert streamed.status_code == 200
        lines = streamed.iter_lines()
        next(line for line in lines if line.startswith("data: "))  # it answers
        two_hosts["gpu-a"].node.link_down()
        try:
            rest = list(lines)  # until the server ends the stream: the host is lost after 4 s here
        finally:
            two_hosts["gpu-a"].node.link_up()
    events = [line[len("data: ") :] for line in rest if line.startswith("data: ")]
    assert events and events[-1] != "[DONE]"  # never a finished answer
    error = json.loads(events[-1])["error"]
    assert error["code"] == "device_offline" and error["reason"] == "lost" and error["model"] == "slow-a"
    assert re.search(r"request \w+ slow-a: host_lost, engine connection closed", server.read_log())
