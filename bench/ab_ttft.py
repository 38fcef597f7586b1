"""Two CapyCTL source trees side by side: the first token's added time of each, at the engine's recorded pace.

    python bench/ab_ttft.py --a SRC_A --b SRC_B [--requests 1200] [--recording DIR] [--case NAME]

SRC_A and SRC_B are ``src`` folders of two checkouts (a worktree of the commit
before a change, say, and the working tree). Each runs as its own CapyCTL
(``PYTHONPATH=SRC``) behind one replay engine that waits its recorded time
before the first chunk. One client sends streamed requests in turn to A, to B
(their order swapped every other request) and straight to the engine, each on
a new connection, and hangs up at the first data event.

The run has two halves. In the second both CapyCTLs are started again, the
other one first: a server's start order (its ports, its place in memory)
moved its figures by about 20 µs on this machine, which alternating requests
alone does not cancel. Printed per half: each tree's added median (its first
token minus the engine's own) and B - A with a bootstrap 95% interval; then
the mean of the two halves' B - A, which cancels the start order.

Differences under about 40 µs are within this machine's noise at 1,200 requests.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from relay import _LISTENING, paced_ttft  # noqa: E402
from tests.integration.harness import CapyServer  # noqa: E402


def start(tmp: Path, name: str, src: str, engine: str) -> CapyServer:
    """A CapyCTL running the code under ``src``, with the replay engine attached as ``bench``."""
    (tmp / name).mkdir()
    os.environ["PYTHONPATH"] = src
    try:
        server = CapyServer(tmp / name / "state").start()
        (tmp / f"{name}.yaml").write_text(f"name: bench\nengine: vllm\nendpoint: {engine}\nengine_version: 0.32.0\n")
        server.cli("deploy", "model", "--file", str(tmp / f"{name}.yaml"))
    finally:
        os.environ.pop("PYTHONPATH")
    return server


def half(tmp: Path, trees: dict[str, str], first: str, engine: str, requests: int) -> dict[str, list[float]]:
    """``requests`` rounds of A, B (in turn first) and the engine; the CapyCTL named ``first`` starts first."""
    order = [first, "B" if first == "A" else "A"]
    servers = {}
    try:
        for name in order:
            servers[name] = start(tmp / f"{first}-first", name, trees[name], engine)
        host, port = engine.removeprefix("http://").split(":")
        body = (b'{"model":"bench","stream":true,"messages":[{"role":"user","content":"hi"}],'
                b'"replay_pace":"recorded"}')
        plain = body.replace(b'"bench"', b'"x"')
        for server in servers.values():  # warm both
            for _ in range(20):
                asyncio.run(paced_ttft("127.0.0.1", server.port, body, server.api_key))
        times: dict[str, list[float]] = {"A": [], "B": [], "engine": []}
        for i in range(requests):
            for name in (("A", "B") if i % 2 else ("B", "A")):
                server = servers[name]
                times[name].append(asyncio.run(paced_ttft("127.0.0.1", server.port, body, server.api_key)) * 1e3)
            times["engine"].append(asyncio.run(paced_ttft(host, int(port), plain, None)) * 1e3)
        return times
    finally:
        for server in servers.values():
            server.stop()


def difference(times: dict[str, list[float]], rng: random.Random) -> tuple[float, float, float]:
    """B - A of the medians, and a bootstrap 95% interval of it."""
    a, b = times["A"], times["B"]
    draws = sorted(statistics.median(rng.choices(b, k=len(b))) - statistics.median(rng.choices(a, k=len(a)))
                   for _ in range(2000))
    return statistics.median(b) - statistics.median(a), draws[50], draws[1949]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", required=True, help="src folder of tree A (the baseline)")
    parser.add_argument("--b", required=True, help="src folder of tree B")
    parser.add_argument("--requests", type=int, default=1200, help="requests to each tree, over both halves")
    parser.add_argument("--recording", default=str(ROOT / "tests/contract/recordings/vllm/0.32.0"))
    parser.add_argument("--case", default="chat_stream_usage")
    args = parser.parse_args()
    trees = {"A": str(Path(args.a).resolve()), "B": str(Path(args.b).resolve())}
    for name, src in trees.items():
        if not (Path(src) / "capyctl" / "__init__.py").is_file():
            parser.error(f"--{name.lower()} {src}: not a src folder (no capyctl/__init__.py in it)")
    if args.requests < 20:
        parser.error("--requests must be at least 20")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks stop every child

    replay = subprocess.Popen([sys.executable, "-m", "capyctl.replay", "--recordings", args.recording, "--port", "0",
                               "--default-case", args.case], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        match = _LISTENING.search(replay.stdout.readline().decode())  # type: ignore[union-attr]
        if not match:
            raise SystemExit("the replay engine did not start")
        engine = f"http://{match.group(1)}:{match.group(2)}"
        tmp = Path(tempfile.mkdtemp(prefix="capyctl-ab-"))
        rng = random.Random(0)
        print(f"A {trees['A']}\nB {trees['B']}\n{args.requests // 2} paced requests to each, per half")
        halves = []
        for first in ("A", "B"):
            (tmp / f"{first}-first").mkdir()
            times = half(tmp, trees, first, engine, args.requests // 2)
            engine_p50 = statistics.median(times["engine"])
            d, low, high = difference(times, rng)
            halves.append(d)
            print(f"{first} started first: added A {statistics.median(times['A']) - engine_p50:.3f} ms, "
                  f"B {statistics.median(times['B']) - engine_p50:.3f} ms, B - A {d * 1000:+.0f} µs "
                  f"(95% {low * 1000:+.0f}..{high * 1000:+.0f})")
        print(f"B - A, start order cancelled: {statistics.mean(halves) * 1000:+.0f} µs")
    finally:
        replay.terminate()
        replay.wait(10)


if __name__ == "__main__":
    main()
