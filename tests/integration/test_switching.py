"""Switching on the real llama-server: three SmolLM2 deployments of 1 GiB on a declared 2.5 GiB device.

Two fit at once. Interleaved bursts to all three must all be answered, each
answer the same as the same request sent alone (temperature 0), with never
three engines running at once (sampled from the process table all along).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import pytest

from tests.integration.harness import CapyServer, LlamaPaths

pytestmark = pytest.mark.integration
NAMES = ("sm-a", "sm-b", "sm-c")
PROMPTS = ("Name a colour.", "Say hello to Ana.", "What is two plus two?", "Name a fruit.")


def body(model: str, prompt: str) -> dict:
    return {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "temperature": 0}


def engines_of(pid: int) -> list[int]:
    """PIDs of llama-server processes whose parent is ``pid`` (CapyCTL's engines: it execs them in place)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/comm") as comm:
                name = comm.read().strip()
        except OSError:
            continue
        if int(fields[1]) == pid and name.startswith("llama-server"):
            found.append(int(entry))
    return found


class Sampler(threading.Thread):
    """Counts CapyCTL's llama-server children every 20 ms; keeps the most seen at once."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.most, self.samples = pid, 0, 0
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            self.most = max(self.most, len(engines_of(self.pid)))
            self.samples += 1
            self.done.wait(0.02)


@pytest.fixture(scope="module")
def switching(tmp_path_factory: pytest.TempPathFactory, llama: LlamaPaths) -> Iterator[CapyServer]:
    tmp = tmp_path_factory.mktemp("switching")
    config = tmp / "server.yaml"
    config.write_text("memory:\n  devices:\n    - name: gpu0\n      capacity: 2.5GiB\n")
    server = CapyServer(tmp / "state", "--config", str(config)).start()
    try:
        server.cli("engine", "add", str(llama.server), "--name", "llama-server")
        for name in NAMES:
            path = tmp / f"{name}.yaml"
            path.write_bytes(
                msgspec.yaml.encode(
                    {
                        "name": name,
                        "engine": "llama-server",
                        "model": str(llama.model),
                        # one slot and one thread each: two engines share the CI machine's 2 cores
                        # without oversubscribing them
                        "engine_config": {"context_length": 2048, "extra_args": ["--parallel", "1", "--threads", "1"]},
                        "resources": {"memory": "1GiB"},
                    }
                )
            )
            server.cli("deploy", "model", "--file", str(path))
        yield server
    finally:
        server.stop()


def test_interleaved_bursts_to_three_models_where_two_fit(switching: CapyServer) -> None:
    assert switching.process is not None
    sampler = Sampler(switching.process.pid)
    sampler.start()
    try:
        with httpx.Client(base_url=switching.base_url, headers=switching.headers(), timeout=300) as client:
            alone = {}
            for name in NAMES:  # each request alone first: the answers to compare with
                for prompt in PROMPTS:
                    r = client.post("/v1/chat/completions", json=body(name, prompt))
                    assert r.status_code == 200, r.text
                    alone[(name, prompt)] = r.json()["choices"][0]["message"]["content"]

        async def burst(client: httpx.AsyncClient, name: str, round_: int) -> list[tuple[str, str, httpx.Response]]:
            asks = [(name, PROMPTS[(i + round_) % len(PROMPTS)]) for i in range(8)]
            replies = await asyncio.gather(*(client.post("/v1/chat/completions", json=body(n, p)) for n, p in asks))
            return [(n, p, r) for (n, p), r in zip(asks, replies, strict=False)]

        async def interleaved() -> list[tuple[str, str, httpx.Response]]:
            async with httpx.AsyncClient(
                base_url=switching.base_url,
                headers=switching.headers(),
                timeout=600,
                limits=httpx.Limits(max_connections=64),
            ) as client:
                tasks = []
                for round_ in range(2):
                    for name in NAMES:
                        tasks.append(asyncio.create_task(burst(client, name, round_)))
                        await asyncio.sleep(0.3)
                return [item for done in await asyncio.gather(*tasks) for item in done]

        answers = asyncio.run(interleaved())
    finally:
        sampler.done.set()
        sampler.join(5)
    failed = [(n, r.status_code, r.text[:200]) for n, _, r in answers if r.status_code != 200]
    assert failed == [] and len(answers) == 48
    differ = [(n, p) for n, p, r in answers if r.json()["choices"][0]["message"]["content"] != alone[(n, p)]]
    assert differ == []
    assert sampler.samples > 50 and sampler.most == 2  # two fit; never three at once
    events = _events(switching)
    completed = [e for e in events if e["kind"] == "switch_completed"]
    assert completed and all(e["detail"]["victims"] for e in completed)
    assert not [e for e in events if e["kind"] == "switch_failed"]


def _events(server: CapyServer) -> list[dict]:
    out = server.cli("events", "--json").stdout
    return [
        e
        for e in (msgspec.json.decode(line) for line in out.splitlines() if line.strip())
        if e["kind"].startswith("switch_")
    ]


def test_a_model_larger_than_the_device_is_refused_with_the_figures(
    switching: CapyServer, tmp_path: Path, llama: LlamaPaths
) -> None:
    path = tmp_path / "big.yaml"
    path.write_bytes(
        msgspec.yaml.encode(
            {"name": "big", "engine": "llama-server", "model": str(llama.model), "resources": {"memory": "3GiB"}}
        )
    )
    switching.cli("deploy", "model", "--file", str(path))
    r = httpx.post(
        switching.base_url + "/v1/chat/completions",
        headers=switching.headers(),
        timeout=60,
        json=body("big", PROMPTS[0]),
    )
    assert r.status_code == 503 and r.headers["retry-after"].isdigit()
    error = r.json()["error"]
    assert error["code"] == "insufficient_memory" and error["model"] == "big"
    assert "needs 3.00 GiB" in error["reason"] and "2.50 GiB" in error["reason"]
    assert switching.cli_json("status", "deployment", "big")["instances"][0]["pid"] is None  # nothing started


def test_a_residency_the_engine_cannot_do_is_refused_when_applied(
    switching: CapyServer, tmp_path: Path, llama: LlamaPaths
) -> None:
    path = tmp_path / "sleepy.yaml"
    path.write_bytes(
        msgspec.yaml.encode(
            {"name": "sleepy", "engine": "llama-server", "model": str(llama.model), "residency": "host_backed"}
        )
    )
    done = switching.cli("deploy", "model", "--file", str(path), check=False)
    assert done.returncode != 0
    assert "residency host_backed is not something llamacpp can do; it can: restart_only" in done.stderr
    assert "sleepy" not in [d["name"] for d in switching.cli_json("list", "deployments")]
