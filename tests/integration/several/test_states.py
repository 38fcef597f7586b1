"""Host states that tell the truth, in network namespaces, and a host's deployments shown as they are.

- An agent stopped (SIGTERM) or killed (SIGKILL): the very next request gets ``503 device_offline`` with a
  ``Retry-After``, never a 502 and never an address; a clean stop is said as such (``engine_ended``, cause
  ``agent_stopped``), never as a crash, and the agent prints no traceback.
- Twenty agent restarts under traffic: no client ever reads ``gate_refused`` (nor a 502, nor an address).
- A restarted server counts each host's silence from its own start (no host reads ``lost`` before
  ``lost_after``), and a host that joined but never ran ``start host`` reads ``joined``.
- ``status deployment`` and ``list deployments`` show the host (text and ``--json``), both ports, and an
  instance held while its host is out of reach.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fakes.standin_venv import make_standin_venv
from tests.integration.machines import CONTROL_PORT, INFERENCE_PORT, Machine, _listed, hosts, invite, joined, until
from tests.integration.netns import Lan
from tests.integration.several.test_serving import deploy, key_of

pytestmark = pytest.mark.integration
ADDRESS = re.compile(r"\b10\.\d+\.\d+\.\d+\b")


def ask(lan: Lan, key: str, model: str = "chat-a", timeout: float = 30) -> httpx.Response:
    return httpx.post(
        f"http://{lan.server.address}:{INFERENCE_PORT}/v1/chat/completions",
        timeout=timeout,
        json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        headers={"authorization": f"Bearer {key}"},
    )


def with_engine(lan: Lan, server: Machine, tmp: Path, name: str = "gpu-a") -> Machine:
    host = joined(lan, server, name, tmp)
    server.cli(
        "engine",
        "add",
        str(make_standin_venv(tmp / f"vllm-{name}", "vllm", "0.32.0")),
        "--host",
        name,
        "--name",
        "vllm",
    )
    return host


def events(server: Machine, kind: str) -> list[dict[str, Any]]:
    lines = server.cli("events", "--json").stdout.splitlines()  # one JSON object a line
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


def offline(answer: httpx.Response) -> None:
    """A refusal a client can act on: 503 device_offline, Retry-After, no internal address."""
    assert answer.status_code == 503, answer.text
    assert answer.json()["error"]["code"] == "device_offline" and int(answer.headers["retry-after"]) >= 1
    assert not ADDRESS.search(answer.text), answer.text


def test_an_agent_stopped_or_killed_is_offline_at_once_and_a_clean_stop_is_no_crash(
    lan: Lan, server: Machine, tmp_path: Path
) -> None:
    host = with_engine(lan, server, tmp_path)
    key = key_of(server)
    deploy(server, tmp_path, "chat-a", "vllm", "gpu-a", str(tmp_path / "model"))
    assert ask(lan, key).status_code == 200
    assert host.process is not None
    host.process.send_signal(signal.SIGTERM)  # its link is closed by the host: known at once
    time.sleep(0.2)  # (within 0.5 s of the signal: a client's next request)
    offline(ask(lan, key))
    assert host.process.wait(30) == 0
    assert "Traceback" not in host.read_log()
    until(lambda: events(server, "engine_ended"), 10, "the engine's end, told with its cause")
    (ended,) = events(server, "engine_ended")
    assert ended["detail"]["cause"] == "agent_stopped"
    assert events(server, "engine_crashed") == []  # a clean stop is not a crash
    status = server.cli("status", "deployment", "chat-a").stdout
    assert "host        gpu-a" in status and "exited with status" not in status

    host.start("host")  # back: the engine is started again on the next request
    until(lambda: hosts(server)["gpu-a"]["state"] == "online", 20, "gpu-a online again")
    until(lambda: ask(lan, key).status_code == 200, 60, "chat-a served again")
    pid = json.loads(server.cli("status", "deployment", "chat-a", "--json").stdout)["instances"][0]["pid"]
    host.process.send_signal(signal.SIGKILL)  # killed: the link resets
    time.sleep(0.2)
    offline(ask(lan, key))
    assert hosts(server)["gpu-a"]["state"] == "disconnected"
    shown = json.loads(server.cli("status", "deployment", "chat-a", "--json").stdout)
    (instance,) = shown["instances"]
    assert instance["state"] == "held" and instance["held"]["reason"] == "disconnected" and instance["pid"] == pid
    assert instance["uptime_s"] is None  # not counted as serving while it is held
    assert "held (disconnected)" in server.cli("list", "deployments").stdout


def test_twenty_agent_restarts_under_traffic_show_no_client_a_gate_refusal(
    lan: Lan, server: Machine, tmp_path: Path
) -> None:
    host = with_engine(lan, server, tmp_path)
    key = key_of(server)
    deploy(server, tmp_path, "chat-a", "vllm", "gpu-a", str(tmp_path / "model"))
    seen: list[tuple[int, str]] = []
    stop = threading.Event()

    def traffic() -> None:  # bounded: until told, or 20 minutes
        ends = time.monotonic() + 1200
        with httpx.Client(timeout=30) as client:
            while not stop.is_set() and time.monotonic() < ends:
                try:
                    answer = client.post(
                        f"http://{lan.server.address}:{INFERENCE_PORT}/v1/chat/completions",
                        json={"model": "chat-a", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
                        headers={"authorization": f"Bearer {key}", "x-llm-wait": "5"},
                    )
                    error = answer.json().get("error", {}) if answer.status_code != 200 else {}
                    seen.append((answer.status_code, error.get("code", "")))
                    if answer.status_code not in (200, 503):
                        seen.append((answer.status_code, answer.text))  # what it said, for the failure's message
                    if ADDRESS.search(answer.text):
                        seen.append((-1, answer.text))
                except httpx.TransportError as error:
                    seen.append((0, type(error).__name__))
                time.sleep(0.05)

    worker = threading.Thread(target=traffic)
    worker.start()
    try:
        for _ in range(20):
            assert host.process is not None
            host.process.send_signal(signal.SIGTERM)
            host.process.wait(30)
            host.start("host")
            until(lambda: _listed(server, "gpu-a") == "online", 30, "gpu-a linked again")
            before = len(seen)
            until(lambda at=before: any(status == 200 for status, _ in seen[at:]), 60, "served again after the restart")
    finally:
        stop.set()
        worker.join(60)
    codes = {code for status, code in seen if status != 200}
    assert "gate_refused" not in codes
    assert all(status in (200, 503) for status, _ in seen), [s for s in seen if s[0] not in (200, 503)]
    assert codes <= {"device_offline", "model_loading", "queued", "engine_restarted"}, codes
    assert sum(1 for status, _ in seen if status == 200) >= 20


def test_a_restarted_server_reads_no_host_lost_before_lost_after_and_a_silent_joiner_joined(
    lan: Lan, server: Machine, tmp_path: Path
) -> None:
    joined(lan, server, "gpu-a", tmp_path)
    never = Machine(lan.hosts["gpu-b"], tmp_path / "gpu-b")
    never.cli("join", "host", "--join-file", str(invite(server, lan, "gpu-b")))  # joined, never started
    assert hosts(server)["gpu-b"]["state"] == "joined"
    time.sleep(4.5)  # longer than lost_after (4 s here): still joined, not lost
    assert hosts(server)["gpu-b"]["state"] == "joined"
    assert server.process is not None
    server.process.send_signal(signal.SIGTERM)
    server.process.wait(30)
    started = time.monotonic()
    server.start(
        "server", "--listen", f"{lan.server.address}:{INFERENCE_PORT}", "--control-listen", f"0.0.0.0:{CONTROL_PORT}"
    )
    states: list[tuple[float, dict[str, str]]] = []

    def look() -> bool:
        done = server.cli("list", "hosts", "--json", check=False)
        if done.returncode == 0:
            states.append((time.monotonic() - started, {h["name"]: h["state"] for h in json.loads(done.stdout)}))
        return bool(states) and states[-1][1].get("gpu-a") == "online"

    until(look, 40, "gpu-a linked to the restarted server")
    # gpu-a's agent dials again within its backoff (up to 10 s): until then it is disconnected, never lost
    assert all(seen["gpu-a"] in ("disconnected", "online") for at, seen in states if at < 4.0), states
    assert all(seen["gpu-b"] == "joined" for _, seen in states), states
    assert "gpu-a" in server.cli("list", "hosts").stdout


def test_a_hosts_deployment_shows_its_host_and_both_ports(lan: Lan, server: Machine, tmp_path: Path) -> None:
    with_engine(lan, server, tmp_path)
    deploy(server, tmp_path, "chat-a", "vllm", "gpu-a", str(tmp_path / "model"))
    shown = json.loads(server.cli("status", "deployment", "chat-a", "--json").stdout)
    (instance,) = shown["instances"]
    assert shown["host"] == "gpu-a" and instance["host"] == "gpu-a"
    assert instance["ingress_port"] == 8444 and instance["port"] not in (None, 8444)  # the engine's own port
    text = server.cli("status", "deployment", "chat-a").stdout
    assert "host        gpu-a" in text and "INGRESS" in text and str(instance["port"]) in text
    listed = server.cli("list", "deployments").stdout
    assert re.search(r"(?m)^NAME\s+API\s+STATE\s+HOST\b", listed) and re.search(r"(?m)^chat-a\s.*\bgpu-a\b", listed)
    assert json.loads(server.cli("list", "deployments", "--json").stdout)[0]["host"] == "gpu-a"
