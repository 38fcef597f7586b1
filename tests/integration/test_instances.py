"""Several instances of one model on one machine, on the real llama-server: ``instances: 2`` on a standalone
CapyCTL with two declared devices runs one engine per device; requests are spread over both; an engine killed
mid-run costs no client an error; the deployment scales down and up without touching the instance that stays.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from tests.integration.harness import CapyServer, LlamaPaths, pid_alive

pytestmark = pytest.mark.integration


def document(llama: LlamaPaths, instances: int) -> dict[str, Any]:
    return {
        "name": "sm",
        "engine": "llama-server",
        "model": str(llama.model),
        "instances": instances,
        "resources": {"memory": "1GiB"},
        # one slot and one thread each: two engines share the CI machine's 2 cores
        "engine_config": {"extra_args": ["--parallel", "1", "--threads", "1"]},
    }


def deploy(server: CapyServer, tmp: Path, llama: LlamaPaths, instances: int) -> dict[str, Any]:
    path = tmp / f"sm-{instances}.yaml"
    path.write_bytes(msgspec.yaml.encode(document(llama, instances)))
    return server.cli_json("deploy", "model", "--file", str(path), "--wait", "--timeout", "120")  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory, llama: LlamaPaths) -> Iterator[tuple[CapyServer, Path]]:
    tmp = tmp_path_factory.mktemp("instances")
    config = tmp / "server.yaml"
    config.write_text(
        "memory:\n  devices:\n    - name: gpu0\n      capacity: 2GiB\n    - name: gpu1\n      capacity: 2GiB\n"
    )
    server = CapyServer(tmp / "state", "--config", str(config)).start()
    try:
        server.cli("engine", "add", str(llama.server), "--name", "llama-server")
        deploy(server, tmp, llama, 2)
        yield server, tmp
    finally:
        server.stop()


def ask(server: CapyServer, prompts: int) -> list[int]:
    """``prompts`` chat requests at once; their statuses."""

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers(), timeout=120) as client:

            async def one(n: int) -> int:
                body = {"model": "sm", "messages": [{"role": "user", "content": f"Count to {n}."}], "max_tokens": 6}
                return (await client.post("/v1/chat/completions", json=body)).status_code

            return list(await asyncio.gather(*(one(n) for n in range(prompts))))

    return asyncio.run(run())


def events(server: CapyServer, kind: str) -> list[dict[str, Any]]:
    lines = server.cli("events", "--deployment", "sm", "--json").stdout.splitlines()
    return [e for e in map(json.loads, lines) if e["kind"] == kind]


def status(server: CapyServer) -> dict[str, Any]:
    return server.cli_json("status", "deployment", "sm")  # type: ignore[no-any-return]


def test_two_declared_devices_run_one_instance_each(two: tuple[CapyServer, Path]) -> None:
    server, _ = two
    shown = status(server)
    rows = [(i["index"], i["host"], i["device"], i["state"]) for i in shown["instances"]]
    assert rows == [(0, None, "gpu0", "ready"), (1, None, "gpu1", "ready")]
    pids = {i["pid"] for i in shown["instances"]}
    assert len(pids) == 2 and all(pid_alive(pid) for pid in pids)
    assert [d["charged_bytes"] for d in server.cli_json("list", "devices")] == [1 << 30, 1 << 30]
    text = server.cli("status", "deployment", "sm").stdout
    assert "instances   2 placed of 2 (spread)" in text and "gpu1" in text and "IN FLIGHT" in text


def test_requests_are_spread_over_both_instances(two: tuple[CapyServer, Path]) -> None:
    server, _ = two
    before = Counter(e["detail"]["instance"] for e in events(server, "router_selection"))
    assert ask(server, 12) == [200] * 12
    after = Counter(e["detail"]["instance"] for e in events(server, "router_selection"))
    sent = after - before
    assert set(sent) == {0, 1} and sum(sent.values()) == 12 and min(sent.values()) >= 3, sent
    chosen = [e for e in events(server, "router_selection") if "inputs" in e["detail"]]
    assert chosen and {s["instance"] for s in chosen[-1]["detail"]["inputs"]} == {0, 1}
    scrape = httpx.get(server.base_url + "/metrics", headers=server.headers()).text
    for index in (0, 1):
        line = f'capyctl_instance_selections_total{{deployment="sm",instance="{index}"}}'
        assert line in scrape and float(scrape.split(line)[1].split()[0]) >= 3


def test_a_killed_engine_costs_no_client_an_error_and_is_started_again(two: tuple[CapyServer, Path]) -> None:
    server, _ = two
    victim = next(i for i in status(server)["instances"] if i["index"] == 1)
    os.kill(victim["pid"], signal.SIGKILL)
    assert ask(server, 8) == [200] * 8  # sent while it is gone, restarting, and back
    deadline = time.monotonic() + 60
    while True:
        again = next(i for i in status(server)["instances"] if i["index"] == 1)
        if again["state"] == "ready" and again["pid"] != victim["pid"]:
            break
        assert time.monotonic() < deadline, again
        time.sleep(0.2)
    assert again["restarts"] == victim["restarts"] + 1
    for failover in events(server, "router_failover"):  # where a request met the dead engine: nothing reached it
        assert failover["detail"]["reason"] == "connection_refused" and failover["detail"]["instance"] == 1


def test_scaling_down_and_up_leaves_the_staying_instance_running(
    two: tuple[CapyServer, Path], llama: LlamaPaths
) -> None:
    server, tmp = two
    first = {i["index"]: i["pid"] for i in status(server)["instances"]}
    result = deploy(server, tmp, llama, 1)
    assert result["outcome"] == "scaled"
    shown = status(server)
    assert [(i["index"], i["pid"]) for i in shown["instances"]] == [(0, first[0])]
    deadline = time.monotonic() + 30
    while pid_alive(first[1]):  # the removed instance's engine is gone
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert ask(server, 3) == [200] * 3
    result = deploy(server, tmp, llama, 2)
    assert result["outcome"] == "scaled"
    shown = status(server)
    assert [(i["index"], i["device"], i["state"]) for i in shown["instances"]] == [
        (0, "gpu0", "ready"),
        (1, "gpu1", "ready"),
    ]
    assert shown["instances"][0]["pid"] == first[0]  # never restarted
    placed = [e["detail"] for e in events(server, "instance_placed")]
    assert placed[-1] == {"instance": 1, "host": None, "device": "gpu1"}
