"""Failover benchmark: what a request pays when the instance it was routed to first refuses the connection
(nothing listens there any more) and it goes to another, against a request routed straight to a live one, in
the same run.

    .venv/bin/python bench/failover.py [--requests 400] [--recording tests/contract/recordings/vllm/0.32.0]

One deployment of two instances, through CapyCTL's own chat service, router and engine session
(``WireEngineSession``, its pool warm): instance 0 points at a loopback port nothing listens on (its engine
is gone, and nothing has told CapyCTL yet: it still counts as ready); instance 1 at a replay engine serving
the recording at its own pace (first chunk about 3.5 ms in). The two instances have equal load, so the
router's turns send every other request to the dead one first; each such request fails over
(``connection_refused``) and is answered by instance 1. Each request is timed from its start to its first
relayed chunk. Printed: first-chunk p50 and p90 for requests that failed over and for those sent straight to
the live instance, and the difference of the p50s: the added time of a failover.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.relay import _LISTENING  # noqa: E402
from capyctl.adapters.engines._wire import WireEngineSession  # noqa: E402
from capyctl.domain.streams import Relayed  # noqa: E402
from capyctl.services.chat import ChatService  # noqa: E402
from capyctl.services.events import Events  # noqa: E402
from capyctl.services.requests import Call, RequestSettings  # noqa: E402
from tests.fakes.ports import FakeStore  # noqa: E402
from tests.integration.harness import free_port  # noqa: E402
from tests.unit.test_failover import fleet_of  # noqa: E402


class Clock:
    def wall(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()


async def run(urls: list[str], requests: int) -> tuple[list[float], list[float]]:
    clock = Clock()
    store = FakeStore()
    events = Events(store, clock)
    session = WireEngineSession()
    service = ChatService(fleet_of(urls, events, clock), session, clock, events, RequestSettings())  # type: ignore[arg-type]
    straight: list[float] = []
    moved: list[float] = []
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    for n in range(requests + 20):
        call = Call(id=f"r{n}", deployment="m", stream=True, obj=dict(body))
        began = time.perf_counter()
        first: list[float] = []

        def write(data: bytes, first: list[float] = first) -> bool:
            if not first and data:
                first.append(time.perf_counter())
            return False

        async with service.open(call):
            await call.pump(write, asyncio.sleep)
        if not first:
            raise RuntimeError("no chunk was relayed")
        if n < 20:
            continue  # warm-up: connections pooled, code paths hot
        (moved if call.tried else straight).append((first[0] - began) * 1000)
    assert Relayed.MORE is not None
    return moved, straight


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--recording", type=Path, default=ROOT / "tests/contract/recordings/vllm/0.32.0")
    args = parser.parse_args()
    engine = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "capyctl.replay",
            "--recordings",
            str(args.recording),
            "--port",
            "0",
            "--pace",
            "recorded",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert engine.stdout is not None
        line = engine.stdout.readline()
        found = _LISTENING.search(line)
        if found is None:
            raise RuntimeError(f"the replay engine did not start: {line}")
        live = f"http://127.0.0.1:{found.group(2)}"
        dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
        moved, straight = asyncio.run(run([dead, live], args.requests))
    finally:
        engine.terminate()
        engine.wait(10)

    def q(values: list[float], at: float) -> float:
        return sorted(values)[min(len(values) - 1, int(at * len(values)))]

    print(f"{len(moved)} requests failed over, {len(straight)} sent straight to the live instance")
    for label, values in (("failed over", moved), ("straight", straight)):
        print(f"  {label:<12} first chunk p50 {statistics.median(values):6.2f} ms  p90 {q(values, 0.9):6.2f} ms")
    print(f"  added by a failover, p50: {statistics.median(moved) - statistics.median(straight):+.2f} ms")


if __name__ == "__main__":
    main()
