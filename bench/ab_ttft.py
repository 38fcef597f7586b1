"""Two CapyCTL source trees side by side: the first token's added time of each, at the engine's recorded pace,
and with ``--cpu-rounds`` their CPU per relayed event under load.

    python bench/ab_ttft.py --a SRC_A --b SRC_B [--requests 1200] [--recording DIR] [--case NAME]
    python bench/ab_ttft.py --a SRC_A --b SRC_B --requests 0 --cpu-rounds 5 [--cpu-seconds 3] \
        [--cpu-streams 32] [--cpu-paced]

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

With ``--cpu-rounds R``, both trees then serve ``--cpu-streams`` clients sending
streams back to back, the engine at full speed (with ``--cpu-paced``: at its recorded
pace, a token a read as from a real engine), for ``--cpu-seconds`` each, A
and B in turn (which goes first swaps every round), R rounds. Each load's CPU
is its server's own (user and system, from /proc) over the events it relayed;
printed per tree: every load's µs of CPU per event and per request, their
medians, and B / A of the medians. ``--requests 0`` skips the first-token part.
A change of a few per cent needs five rounds or more: loads one after another
on a shared machine differ by about that much.
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

from relay import _LISTENING, cpu_seconds, load, paced_ttft  # noqa: E402

from tests.integration.harness import CapyServer  # noqa: E402


def start(tmp: Path, name: str, src: str, engine: str, *extra: str) -> CapyServer:
    """A CapyCTL running the code under ``src``, with the replay engine attached as ``bench``."""
    (tmp / name).mkdir()
    os.environ["PYTHONPATH"] = src
    try:
        server = CapyServer(tmp / name / "state", *extra).start()
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
        body = b'{"model":"bench","stream":true,"messages":[{"role":"user","content":"hi"}],"replay_pace":"recorded"}'
        plain = body.replace(b'"bench"', b'"x"')
        for server in servers.values():  # warm both
            for _ in range(20):
                asyncio.run(paced_ttft("127.0.0.1", server.port, body, server.api_key))
        times: dict[str, list[float]] = {"A": [], "B": [], "engine": []}
        for i in range(requests):
            for name in ("A", "B") if i % 2 else ("B", "A"):
                server = servers[name]
                times[name].append(asyncio.run(paced_ttft("127.0.0.1", server.port, body, server.api_key)) * 1e3)
            times["engine"].append(asyncio.run(paced_ttft(host, int(port), plain, None)) * 1e3)
        return times
    finally:
        for server in servers.values():
            server.stop()


def cpu_loads(
    tmp: Path,
    trees: dict[str, str],
    engine: str,
    case: str,
    events: int,
    rounds: int,
    seconds: float,
    streams: int,
    paced: bool = False,
) -> dict[str, list[float]]:
    """µs of server CPU per relayed event in each of ``rounds`` alternated loads per tree; ``paced``: the engine
    sends at its recorded pace (a token a read, as a real engine does), not as fast as it can."""
    (tmp / "cpu").mkdir()
    config = tmp / "cpu.yaml"  # a slot for every client: this measures the relay, not the queue
    config.write_text(
        f"queue:\n  max_in_flight_per_instance: {streams}\n  max_pending_per_deployment: {streams}\n"
        f"  max_pending_total: {streams}\n"
    )
    servers = {}
    try:
        for name in ("A", "B"):
            servers[name] = start(tmp / "cpu", name, trees[name], engine, "--config", str(config))
        body = b'{"model":"bench","stream":true,"replay_case":"%b","messages":[{"role":"user","content":"hi"}]}' % (
            case.encode()
        )
        if paced:
            body = body[:-1] + b',"replay_pace":"recorded"}'
        for server in servers.values():  # warm both
            asyncio.run(load("127.0.0.1", server.port, body, server.api_key, streams, 0.5, events))
        per_event: dict[str, list[float]] = {"A": [], "B": []}
        for round_ in range(rounds):
            for name in ("A", "B") if round_ % 2 == 0 else ("B", "A"):
                server = servers[name]
                pid = server.process.pid  # type: ignore[union-attr]
                before = cpu_seconds(pid)
                got = asyncio.run(load("127.0.0.1", server.port, body, server.api_key, streams, seconds, events))
                per_event[name].append((cpu_seconds(pid) - before) / got["chunks"] * 1e6)
        return per_event
    finally:
        for server in servers.values():
            server.stop()


def difference(times: dict[str, list[float]], rng: random.Random) -> tuple[float, float, float]:
    """B - A of the medians, and a bootstrap 95% interval of it."""
    a, b = times["A"], times["B"]
    draws = sorted(
        statistics.median(rng.choices(b, k=len(b))) - statistics.median(rng.choices(a, k=len(a))) for _ in range(2000)
    )
    return statistics.median(b) - statistics.median(a), draws[50], draws[1949]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", required=True, help="src folder of tree A (the baseline)")
    parser.add_argument("--b", required=True, help="src folder of tree B")
    parser.add_argument("--requests", type=int, default=1200, help="requests to each tree, over both halves")
    parser.add_argument("--recording", default=str(ROOT / "tests/contract/recordings/vllm/0.32.0"))
    parser.add_argument("--case", default="chat_stream_usage")
    parser.add_argument(
        "--cpu-rounds",
        type=int,
        default=0,
        help="also alternate this many loads per tree and compare their CPU per event (0: no)",
    )
    parser.add_argument("--cpu-seconds", type=float, default=3.0, help="seconds per load")
    parser.add_argument("--cpu-streams", type=int, default=32, help="clients sending streams back to back in a load")
    parser.add_argument(
        "--cpu-paced",
        action="store_true",
        help="the engine sends the CPU loads' streams at its recorded pace (a token a read, as a real "
        "engine does) rather than as fast as it can",
    )
    args = parser.parse_args()
    trees = {"A": str(Path(args.a).resolve()), "B": str(Path(args.b).resolve())}
    for name, src in trees.items():
        if not (Path(src) / "capyctl" / "__init__.py").is_file():
            parser.error(f"--{name.lower()} {src}: not a src folder (no capyctl/__init__.py in it)")
    if args.requests < 20 and not (args.requests == 0 and args.cpu_rounds > 0):
        parser.error("--requests must be at least 20 (or 0 with --cpu-rounds, to skip the first token)")
    if args.cpu_rounds < 0 or args.cpu_seconds <= 0 or args.cpu_streams < 1:
        parser.error("--cpu-rounds must be 0 or more, --cpu-seconds above 0, --cpu-streams at least 1")
    events = (Path(args.recording) / f"{args.case}.sse").read_bytes().count(b"data: ") if args.cpu_rounds else 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the finally blocks stop every child

    replay = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "capyctl.replay",
            "--recordings",
            args.recording,
            "--port",
            "0",
            "--default-case",
            args.case,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        match = _LISTENING.search(replay.stdout.readline().decode())  # type: ignore[union-attr]
        if not match:
            raise SystemExit("the replay engine did not start")
        engine = f"http://{match.group(1)}:{match.group(2)}"
        tmp = Path(tempfile.mkdtemp(prefix="capyctl-ab-"))
        rng = random.Random(0)
        print(f"A {trees['A']}\nB {trees['B']}")
        if args.requests:
            first_token(tmp, trees, engine, args.requests, rng)
        if args.cpu_rounds:
            print(
                f"{args.cpu_rounds} loads per tree of {args.cpu_seconds:g} s, {args.cpu_streams} streams of "
                f"{args.case} ({events} events), the engine "
                f"{'at its recorded pace' if args.cpu_paced else 'at full speed'}"
            )
            per_event = cpu_loads(
                tmp,
                trees,
                engine,
                args.case,
                events,
                args.cpu_rounds,
                args.cpu_seconds,
                args.cpu_streams,
                args.cpu_paced,
            )
            for name in ("A", "B"):
                loads = per_event[name]
                print(
                    f"{name} CPU µs per event: {' '.join(f'{v:.2f}' for v in loads)} (median "
                    f"{statistics.median(loads):.2f}); per request: {' '.join(f'{v * events:.0f}' for v in loads)}"
                )
            ratio = statistics.median(per_event["B"]) / statistics.median(per_event["A"])
            print(f"B / A, CPU per event (medians): {ratio:.3f}")
    finally:
        replay.terminate()
        replay.wait(10)


def first_token(tmp: Path, trees: dict[str, str], engine: str, requests: int, rng: random.Random) -> None:
    """The first-token part: two halves, each tree started first once."""
    print(f"{requests // 2} paced requests to each, per half")
    halves = []
    for first in ("A", "B"):
        (tmp / f"{first}-first").mkdir()
        times = half(tmp, trees, first, engine, requests // 2)
        engine_p50 = statistics.median(times["engine"])
        d, low, high = difference(times, rng)
        halves.append(d)
        print(
            f"{first} started first: added A {statistics.median(times['A']) - engine_p50:.3f} ms, "
            f"B {statistics.median(times['B']) - engine_p50:.3f} ms, B - A {d * 1000:+.0f} µs "
            f"(95% {low * 1000:+.0f}..{high * 1000:+.0f})"
        )
    print(f"B - A, start order cancelled: {statistics.mean(halves) * 1000:+.0f} µs")


if __name__ == "__main__":
    main()
