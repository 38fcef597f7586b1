"""CapyCTL's own cost on a cold start and on a wake: what a request waits beyond the engine's own time.

    python bench/coldstart.py [--rounds 10]

Cold start (real llama-server with SmolLM2, residency restart_only): each
round parks the deployment (which stops it), then times one streamed request
from its send to its first token through CapyCTL. In the same run, alternating
with those rounds, the same llama-server command line (read from the engine
CapyCTL ran) is spawned directly, while CapyCTL's engine is stopped, and timed
from its spawn to the first token of the same request sent the moment
``/health`` answers 200 (polled every 2 ms). CapyCTL's cost is the difference
of the medians; a second figure subtracts, per round, that launch's own
spawn-to-ready as CapyCTL timed it (10 ms polls) and the direct ready-to-first-
token.

Wake (the stand-in engine as vLLM 0.32.0, residency host_backed): each round
parks the deployment (the engine sleeps), then times one streamed request to
its first token. The engine's own time is read from the stand-in's timeline:
from the first wake call it received to the moment it was awake again. The
cost is each round's difference; the canary after the wake is part of it
(the stand-in's token delay is 0 here, so the canary's own generation costs
nothing).

Printed: each round's raw figures, then the p50 of CapyCTL's cost (target
50 ms or less) for both.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import msgspec

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.fakes.standin_engine import read_timeline  # noqa: E402
from tests.fakes.standin_venv import make_standin_venv  # noqa: E402
from tests.integration.harness import CapyServer, free_port, llama_paths  # noqa: E402

BODY = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, "temperature": 0, "stream": True}


async def first_token(url: str, body: dict, headers: dict[str, str]) -> float:
    """time.time() when the first content chunk of a streamed answer arrived."""
    async with (
        httpx.AsyncClient(timeout=300) as client,
        client.stream("POST", url, json=body, headers=headers) as response,
    ):
        if response.status_code != 200:
            raise SystemExit(f"{url} answered {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if line.startswith("data: ") and '"content"' in line and '"content":null' not in line:
                return time.time()
    raise SystemExit("the answer ended without content")


def through_capyctl(server: CapyServer, name: str) -> float:
    """Seconds from sending a request for a parked (or stopped) model to its first token."""
    server.cli("park", "deployment", name)
    began = time.time()
    got = asyncio.run(first_token(server.base_url + "/v1/chat/completions", {"model": name, **BODY}, server.headers()))
    return got - began


def engine_argv(server: CapyServer, name: str) -> list[str]:
    pid = server.cli_json("status", "deployment", name)["instances"][0]["pid"]
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


def direct(argv: list[str], name: str) -> tuple[float, float]:
    """Seconds from spawning the engine to /health 200, and to the first token of the request sent then."""
    port = free_port()
    argv = list(argv)
    argv[argv.index("--port") + 1] = str(port)
    base = f"http://127.0.0.1:{port}"
    began = time.time()
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with httpx.Client(timeout=1) as client:
            while True:
                try:
                    if client.get(base + "/health").status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if process.poll() is not None:
                    raise SystemExit(f"llama-server exited with {process.returncode}")
                time.sleep(0.002)
        ready = time.time()
        got = asyncio.run(first_token(base + "/v1/chat/completions", {"model": name, **BODY}, {}))
        return ready - began, got - began
    finally:
        process.terminate()
        process.wait(10)


def ms(seconds: float) -> str:
    return f"{seconds * 1000:8.1f}"


def cold_starts(work: Path, rounds: int) -> float:
    llama = llama_paths()
    server = CapyServer(work / "cold-state").start()
    try:
        server.cli("engine", "add", str(llama.server), "--name", "llama-server")
        path = work / "cold.yaml"
        path.write_bytes(
            msgspec.yaml.encode(
                {
                    "name": "cold",
                    "engine": "llama-server",
                    "model": str(llama.model),
                    "engine_config": {"context_length": 2048, "extra_args": ["--parallel", "1"]},
                }
            )
        )
        server.cli("deploy", "model", "--file", str(path), "--wait")
        argv = engine_argv(server, "cold")
        capy, own, seen, rest = [], [], [], []
        print("cold start (llama-server, SmolLM2-135M), ms")
        print(
            "   round   through CapyCTL:   request -> 1st token   its spawn -> ready   |   direct: spawn -> "
            "ready   spawn -> 1st token"
        )
        for i in range(rounds):
            server.cli("park", "deployment", "cold")  # CapyCTL's engine gone: the direct one has the cores alone
            ready, first = direct(argv, "cold")
            capy.append(through_capyctl(server, "cold"))
            seen.append(server.cli_json("status", "deployment", "cold")["instances"][0]["cold_starts_s"][-1])
            own.append(first)
            rest.append(first - ready)
            print(
                f"   {i + 1:5d}   {ms(capy[-1])}               {ms(seen[-1])}           |   {ms(ready)}"
                f"            {ms(first)}"
            )
        cost = statistics.median(capy) - statistics.median(own)
        print(
            f"   median  {ms(statistics.median(capy))}                                    |"
            f"                       {ms(statistics.median(own))}"
        )
        print(f"CapyCTL's cost on a cold start: p50 {cost * 1000:.1f} ms (difference of the medians; target <= 50 ms)")
        after_ready = statistics.median(rest)  # the engine's own time from ready to its first token
        per_round = [total - start - after_ready for total, start in zip(capy, seen, strict=False)]
        print(
            f"   per round, request -> 1st token less that launch's spawn -> ready (CapyCTL's reading, to 10 ms) "
            f"and the direct ready -> 1st token ({after_ready * 1000:.1f} ms): p50 "
            f"{statistics.median(per_round) * 1000:.1f} ms"
        )
        return cost
    finally:
        server.stop()


def wakes(work: Path, rounds: int) -> float:
    config = work / "server.yaml"
    config.write_text("memory:\n  devices:\n    - name: gpu0\n      capacity: 8GiB\n")
    timeline = work / "timeline.jsonl"
    server = CapyServer(work / "wake-state", "--config", str(config)).start()
    try:
        venv = make_standin_venv(work / "vllm-venv", "vllm", "0.32.0")
        server.cli("engine", "add", str(venv), "--name", "vllm")
        (work / "model").mkdir(exist_ok=True)
        path = work / "warm.yaml"
        path.write_bytes(
            msgspec.yaml.encode(
                {
                    "name": "warm",
                    "engine": "vllm",
                    "model": str(work / "model"),
                    "residency": "host_backed",
                    "resources": {"memory": "4GiB", "parked_memory": "1GiB"},
                    "engine_config": {
                        "env": {
                            "STANDIN_TIMELINE": str(timeline),
                            "STANDIN_TOKEN_DELAY_MS": "0",
                            "STANDIN_WAKE_S": "0.2",
                        }
                    },
                }
            )
        )
        server.cli("deploy", "model", "--file", str(path), "--wait")
        costs = []
        print("wake (stand-in as vLLM 0.32.0, host_backed): ms")
        print("   round   request -> first token   engine's wake   CapyCTL's cost")
        for i in range(rounds):
            seen = len(read_timeline(timeline))
            total = through_capyctl(server, "warm")
            lines = read_timeline(timeline)[seen:]
            calls = [line for line in lines if line.get("event") == "call" and line.get("path") == "/wake_up"]
            woken = [line for line in lines if line.get("event") == "woken"]
            if not calls or not woken:
                raise SystemExit(f"no wake in the timeline: {json.dumps(lines)[:500]}")
            own = woken[0]["at"] - calls[0]["at"]
            costs.append(total - own)
            print(f"   {i + 1:5d}   {ms(total)}               {ms(own)}        {ms(costs[-1])}")
        cost = statistics.median(costs)
        print(
            f"CapyCTL's cost on a wake: p50 {cost * 1000:.1f} ms, p90 "
            f"{sorted(costs)[int(0.9 * (len(costs) - 1))] * 1000:.1f} ms (target p50 <= 50 ms)"
        )
        return cost
    finally:
        server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    args = parser.parse_args()
    print(f"coldstart benchmark, {os.cpu_count()} cores, {args.rounds} rounds each")
    with tempfile.TemporaryDirectory(prefix="capyctl-coldstart-") as tmp:
        cold_starts(Path(tmp), args.rounds)
        wakes(Path(tmp), args.rounds)


if __name__ == "__main__":
    main()
