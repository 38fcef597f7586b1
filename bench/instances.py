"""Two instances on two hosts against each engine alone: the throughput a model of two instances gets at 64
streams, as a share of the sum of what each engine gives alone through the same server, in one run. Needs
root (``ip netns``).

    sudo .venv/bin/python bench/instances.py [--streams 64] [--seconds 8] [--rounds 3] [--slots 8]

Three network namespaces stand for the server and two hosts (``tests/integration/netns.py``); CapyCTL runs in
them as on three machines (``start server``, ``join host``, ``start host``). Each host runs stand-in vLLM
engines (``tests/fakes/standin_engine.py``: 10 ms a token, at most ``--slots`` requests generating at once,
the rest waiting, as ``--max-num-seqs`` makes vLLM do), so that an engine, not the relay, is what limits
throughput. Three deployments of the same engine: ``solo-a`` (one instance, on gpu-a), ``solo-b`` (one, on
gpu-b) and ``pair`` (two instances, ``placement.max_per_host: 1``: one on each). Each round loads each
deployment in turn (the order rotated) with ``--streams`` clients sending 16-token streams back to back for
``--seconds``; throughput is completed requests a second. Printed: each deployment's throughput per round
and their medians, and ``pair / (solo-a + solo-b)``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.relay import one_stream  # noqa: E402
from tests.fakes.standin_venv import make_standin_venv  # noqa: E402
from tests.integration.machines import INFERENCE_PORT, Machine, joined  # noqa: E402
from tests.integration.netns import Lan, available  # noqa: E402
from tests.integration.several.conftest import start_server  # noqa: E402
from tests.integration.several.test_serving import key_of  # noqa: E402

DEPLOYMENTS = ("solo-a", "solo-b", "pair")


async def throughput(host: str, key: str, model: str, streams: int, seconds: float) -> float:
    """Completed streams a second, ``streams`` clients back to back for ``seconds``."""
    body = msgspec.json.encode(
        {"model": model, "messages": [{"role": "user", "content": "go"}], "max_tokens": 16, "stream": True}
    )
    done = 0
    stop = time.perf_counter() + seconds

    async def client() -> None:
        nonlocal done
        while time.perf_counter() < stop:
            _, chunks = await one_stream(host, INFERENCE_PORT, body, key)
            if chunks < 2:
                raise SystemExit(f"a stream of {model} carried {chunks} data events: it failed")
            done += 1

    began = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(streams)))
    return done / (time.perf_counter() - began)


def deploy(server: Machine, tmp: Path, name: str, slots: int, **extra: object) -> None:
    document = {
        "name": name,
        "engine": "vllm",
        "model": str(tmp / "model"),
        "engine_config": {"extra_args": ["--max-num-seqs", str(slots)]},
        **extra,
    }
    path = tmp / f"{name}.yaml"
    path.write_bytes(msgspec.yaml.encode(document))
    server.cli("deploy", "model", "--file", str(path), "--activate", "--wait", timeout=180)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--slots", type=int, default=8)
    args = parser.parse_args()
    why = available()
    if why is not None:
        raise SystemExit(why)
    with tempfile.TemporaryDirectory(prefix="capyctl-instances-") as tmp_name, Lan(["gpu-a", "gpu-b"]) as lan:
        tmp = Path(tmp_name)
        server = start_server(lan, tmp)
        venv = make_standin_venv(tmp / "vllm", "vllm", "0.32.0")
        for name in ("gpu-a", "gpu-b"):
            joined(lan, server, name, tmp, env={"STANDIN_TOKEN_DELAY_MS": "10"})
            server.cli("engine", "add", str(venv), "--host", name, "--name", "vllm")
        deploy(server, tmp, "solo-a", args.slots, host="gpu-a")
        deploy(server, tmp, "solo-b", args.slots, host="gpu-b")
        deploy(server, tmp, "pair", args.slots, instances=2, placement={"max_per_host": 1})
        placed = json.loads(server.cli("status", "deployment", "pair", "--json").stdout)["instances"]
        where = ", ".join(f"{i['index']} on {i['host']}" for i in placed)
        print(f"pair's instances: {where}")
        key = key_of(server)
        figures: dict[str, list[float]] = {name: [] for name in DEPLOYMENTS}
        for round_ in range(args.rounds):
            order = DEPLOYMENTS[round_ % 3 :] + DEPLOYMENTS[: round_ % 3]
            for name in order:
                figures[name].append(asyncio.run(throughput(lan.server.address, key, name, args.streams, args.seconds)))
            print(f"round {round_ + 1}: " + ", ".join(f"{n} {figures[n][-1]:.1f}/s" for n in DEPLOYMENTS))
    medians = {name: statistics.median(values) for name, values in figures.items()}
    ratio = medians["pair"] / (medians["solo-a"] + medians["solo-b"])
    print(
        f"median completed streams/s at {args.streams} streams: solo-a {medians['solo-a']:.1f}, solo-b "
        f"{medians['solo-b']:.1f}, pair {medians['pair']:.1f}; pair / (solo-a + solo-b) = {ratio:.3f}"
    )


if __name__ == "__main__":
    main()
