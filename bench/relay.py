"""Relay benchmark: N concurrent streams straight to the replay engine vs. through CapyCTL, in one run.

    python bench/relay.py [--recording tests/contract/recordings/vllm/0.32.0] [--case chat_stream_usage]
                          [--concurrency 1,16,64,256] [--seconds 3]

The replay engine serves a recorded real stream at full speed. For each N the
two paths are measured alternately (direct, relayed, direct, relayed) so a
noisy machine hurts both alike. Printed per N: time to first chunk p50/p99 of
each path and the added median, chunks per second of each path and their
ratio, and CapyCTL's CPU seconds per 1,000 relayed chunks (from /proc).
Figures are ratios against the direct baseline measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.harness import CapyServer  # noqa: E402

_LISTENING = re.compile(r"listening on http://([\d.]+):(\d+)")


def request(host: str, body: bytes, key: str | None) -> bytes:
    """A streamed chat request, as raw bytes (a lean client, the same for both paths)."""
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n{auth}Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


async def one_stream(host: str, port: int, body: bytes, key: str | None) -> tuple[float, int]:
    """(seconds to the first data chunk, data chunks received) for one streamed request."""
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(request(host, body, key))
    first = 0.0
    chunks = 0
    tail = b""
    while data := await reader.read(65536):
        window = tail + data
        found = window.count(b"data: ")
        if found and not first:
            first = time.perf_counter() - started
        chunks += found
        tail = window[-5:]
    writer.close()
    return first, chunks


async def load(host: str, port: int, body: bytes, key: str | None, n: int, seconds: float, expect: int) -> dict:
    """N workers sending requests back to back; every answer must carry the whole recording."""
    ttfts: list[float] = []
    chunks = 0
    stop = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal chunks
        while time.perf_counter() < stop:
            first, got = await one_stream(host, port, body, key)
            if got != expect:
                raise SystemExit(f"a stream carried {got} data events instead of {expect}: the relay lost some")
            ttfts.append(first)
            chunks += got

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(n)))
    elapsed = time.perf_counter() - began
    return {"ttfts": ttfts, "chunks": chunks, "elapsed": elapsed}


async def hang_up_delay(host: str, port: int, body: bytes, key: str, stats_url: str) -> float:
    """Seconds from a client hang-up to the engine seeing its connection closed (polled on /replay/stats)."""
    import httpx

    async with httpx.AsyncClient() as client:
        before = (await client.get(stats_url)).json()["disconnected"]
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(request(host, body, key))
        while b"data: " not in await reader.read(65536):
            pass
        writer.transport.abort()
        gone = time.perf_counter()
        while (await client.get(stats_url)).json()["disconnected"] == before:
            pass
        return time.perf_counter() - gone


async def paced_ttft(host: str, port: int, body: bytes, key: str | None) -> float:
    """Seconds to the first data event of one stream from an engine at its recorded pace; then hang up."""
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(request(host, body, key))
    while b"data: " not in await reader.read(65536):
        pass
    first = time.perf_counter() - started
    writer.transport.abort()
    await asyncio.sleep(0.02)  # let both sides finish with the cut stream before the next one
    return first


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recording", default=str(ROOT / "tests/contract/recordings/vllm/0.32.0"))
    parser.add_argument("--case", default="chat_stream_usage")
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per path and round")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of direct and relayed per N")
    parser.add_argument("--hangups", type=int, default=20, help="client hang-ups to time (0: none)")
    parser.add_argument("--handoff", type=int, default=256,
                        help="streams waiting on one slot, to time a freed slot's hand-over to the next (0: none)")
    parser.add_argument("--paced", type=int, default=60,
                        help="streams per path to time to first token with the engine at its recorded pace (0: none)")
    args = parser.parse_args()
    if not 0 <= args.handoff <= 1000:
        parser.error("--handoff must be within 0..1000 (the replay engine keeps its last 1,000 idle gaps)")
    recording = Path(args.recording)
    engine, version = recording.parent.name, recording.name

    replay = subprocess.Popen(
        [sys.executable, "-m", "capyctl.replay", "--dialect", engine, "--version", version,
         "--recordings", str(recording), "--port", "0", "--pace", "fast"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    tmp = Path(tempfile.mkdtemp(prefix="capyctl-bench-"))
    most = max(int(x) for x in args.concurrency.split(","))
    relay_config = tmp / "relay.yaml"  # every client at the engine at once: this measures the relay, not the queue
    relay_config.write_text(f"queue:\n  max_in_flight_per_instance: {most}\n  max_pending_per_deployment: {most}\n"
                            f"  max_pending_total: {most}\n")
    capy = CapyServer(tmp / "state", "--config", str(relay_config))
    try:
        line = replay.stdout.readline().decode()  # type: ignore[union-attr]
        match = _LISTENING.search(line)
        assert match, f"replay engine did not start: {line}"
        rhost, rport = match.group(1), int(match.group(2))
        capy.start()
        deployment = tmp / "bench.yaml"
        deployment.write_text(
            f"name: bench\nengine: {engine}\nendpoint: http://{rhost}:{rport}\nengine_version: {version}\n")
        capy.cli("deploy", "model", "--file", str(deployment))
        body = (b'{"model":"bench","stream":true,"replay_case":"%s",'
                b'"messages":[{"role":"user","content":"hi"}]}' % args.case.encode())
        pid = capy.process.pid  # type: ignore[union-attr]
        expect = (recording / f"{args.case}.sse").read_bytes().count(b"data: ")
        print(f"relay benchmark: {engine} {version} case {args.case}, {os.cpu_count()} cores, "
              f"{args.rounds}x{args.seconds:.0f} s per path and N")
        print(f"{'N':>4} {'ttft p50 direct/relay ms':>26} {'added p50':>10} {'ttft p99 direct/relay ms':>26} "
              f"{'chunks/s direct':>16} {'relay':>10} {'ratio':>6} {'CPU s/1k chunks':>16}")
        for n in (int(x) for x in args.concurrency.split(",")):
            direct = {"ttfts": [], "chunks": 0, "elapsed": 0.0}
            relay = {"ttfts": [], "chunks": 0, "elapsed": 0.0}
            cpu = 0.0
            for _ in range(args.rounds):
                for target, sink in (("direct", direct), ("relay", relay)):
                    before = cpu_seconds(pid)
                    if target == "direct":
                        got = asyncio.run(load(rhost, rport, body.replace(b'"bench"', b'"x"'), None, n, args.seconds, expect))
                    else:
                        got = asyncio.run(load("127.0.0.1", capy.port, body, capy.api_key, n, args.seconds, expect))
                        cpu += cpu_seconds(pid) - before
                    sink["ttfts"] += got["ttfts"]
                    sink["chunks"] += got["chunks"]
                    sink["elapsed"] += got["elapsed"]
            d_rate = direct["chunks"] / direct["elapsed"]
            r_rate = relay["chunks"] / relay["elapsed"]
            added = statistics.median(relay["ttfts"]) * 1000 - statistics.median(direct["ttfts"]) * 1000
            print(f"{n:>4} {pct(direct['ttfts'], .5):>12.2f} / {pct(relay['ttfts'], .5):>9.2f} {added:>10.2f} "
                  f"{pct(direct['ttfts'], .99):>12.2f} / {pct(relay['ttfts'], .99):>9.2f} "
                  f"{d_rate:>16.0f} {r_rate:>10.0f} {r_rate / d_rate:>6.2f} {cpu / relay['chunks'] * 1000:>16.3f}")
        if args.paced:
            paced_body = body[:-1] + b',"replay_pace":"recorded"}'
            direct_t, relay_t = [], []
            for _ in range(args.paced):
                direct_t.append(asyncio.run(paced_ttft(rhost, rport, paced_body.replace(b'"bench"', b'"x"'), None)))
                relay_t.append(asyncio.run(paced_ttft("127.0.0.1", capy.port, paced_body, capy.api_key)))
            print(f"time to first token, engine at its recorded pace, one stream: direct p50 {pct(direct_t, .5):.2f} ms, "
                  f"relayed p50 {pct(relay_t, .5):.2f} ms, added {pct(relay_t, .5) - pct(direct_t, .5):.2f} ms "
                  f"over {args.paced} streams each")
        if args.hangups:
            paced = body[:-1] + b',"replay_pace":"recorded"}'
            stats_url = f"http://{rhost}:{rport}/replay/stats"
            delays = [asyncio.run(hang_up_delay("127.0.0.1", capy.port, paced, capy.api_key, stats_url))
                      for _ in range(args.hangups)]
            print(f"client hang-up -> engine connection closed: p50 {pct(delays, .5):.2f} ms, "
                  f"p99 {pct(delays, .99):.2f} ms over {len(delays)} streams (includes one stats poll)")
        if args.handoff:
            gaps = handoff(tmp, f"http://{rhost}:{rport}", engine, version, body, expect, args.handoff)
            print(f"slot freed -> next waiter sent to the engine (one slot, {args.handoff} waiting): "
                  f"p50 {statistics.median(gaps):.2f} ms, p99 {pct_ms(gaps, .99):.2f} ms over {len(gaps)} hand-overs")
    finally:
        capy.stop()
        replay.terminate()
        replay.wait(10)


def pct_ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def handoff(tmp: Path, engine_url: str, engine: str, version: str, body: bytes, expect: int, n: int) -> list[float]:
    """Milliseconds from the engine finishing one answer to the next waiting request reaching it.

    A second CapyCTL with one slot per instance and room for ``n`` waiters; ``n`` streams at once
    through it, so the engine is only ever busy with one. The replay engine notes each idle gap
    (its last answer sent, to the next request's arrival): with a queue behind the slot, that gap
    is CapyCTL's hand-over: the lease returned, the next waiter woken, its request sent.
    """
    import httpx

    config = tmp / "one-slot.yaml"
    config.write_text(f"queue:\n  max_in_flight_per_instance: 1\n  max_pending_per_deployment: {n}\n"
                      f"  max_pending_total: {n}\n")
    one = CapyServer(tmp / "one-slot-state", "--config", str(config))
    try:
        one.start()
        deployment = tmp / "one.yaml"
        deployment.write_text(f"name: bench\nengine: {engine}\nendpoint: {engine_url}\nengine_version: {version}\n")
        one.cli("deploy", "model", "--file", str(deployment))
        asyncio.run(load("127.0.0.1", one.port, body, one.api_key, 1, 0.2, expect))  # warm: ready, one connection

        async def all_waiting() -> None:
            results = await asyncio.gather(*(one_stream("127.0.0.1", one.port, body, one.api_key) for _ in range(n)))
            if any(got != expect for _, got in results):
                raise SystemExit("a stream through the one-slot CapyCTL was not whole")

        asyncio.run(all_waiting())
        gaps = httpx.get(engine_url + "/replay/stats", timeout=10).json()["idle_gaps_ms"]
        return gaps[-(n - 1):]  # the engine served only these since: its last n-1 idle gaps are theirs
    finally:
        one.stop()


if __name__ == "__main__":
    main()
