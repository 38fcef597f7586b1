"""Many streams held open at once: what each open stream costs CapyCTL in memory and file descriptors.

    python bench/streams.py [--streams 1000] [--interval-ms 500] [--hold 5] [--json]

What it does. It starts a replay engine (the recorded vLLM 0.32.0 streams, case
chat_stream_usage) and a CapyCTL with the engine attached as the deployment "streams",
warms CapyCTL up with a few requests, and then opens --streams streamed requests at the
same time, each on its own connection. The engine sends one event every --interval-ms
(500 ms: a stream of 203 events would last about 100 s), so the streams stay open. Once
every stream has received its first event (at most --open-timeout s) it holds them all
open for --hold s more, then hangs up on all of them and waits for CapyCTL to settle
(until its fd count stops falling, at most --settle s).

CapyCTL's resident memory (VmRSS) and open file descriptors (/proc/PID/fd) are read:

  before   idle, after the warm-up
  during   all streams open: the peak of samples taken every 100 ms from the first
           connection to the hang-up
  after    every stream closed, after the settle wait

with "per stream" = (during - before) / streams, and CapyCTL's sockets split into client
connections, engine connections and the rest at each point. During, both kinds should
be about --streams (one client and one engine connection per stream); after, the client
connections should be gone and the engine connections back to the idle pool (at most
64) plus any idle health-check connections. The replay engine's own count of running
streams (GET /replay/stats) is shown while all are open and after the hang-up; it should
be --streams and then 0. A stream that ends before the hang-up is counted as "ended
early" (the stream is still supposed to be trickling).

The bench raises its own RLIMIT_NOFILE soft limit to the hard limit first; the replay
engine and CapyCTL inherit it. Exit status 1 when RSS during is above --max-rss-mb (300),
when not every stream got its first event, when a stream ended early, or when CapyCTL
is no longer running; 0 otherwise. --json prints the same as one JSON object.
All traffic is on 127.0.0.1; both processes are stopped on the way out, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.soak import (  # noqa: E402
    HOST,
    RECORDING,
    Record,
    Sampler,
    Stack,
    chat_body,
    chat_request,
    describe_fds,
    entry,
    fd_breakdown,
    fd_count,
    http_get,
    one_request,
    raise_fd_limit,
    rss_kb,
    run_bench,
    settle,
)

_decode = json.loads


class _Held(asyncio.Protocol):
    """One held-open stream: notes its first data event, then only counts bytes."""

    __slots__ = ("first", "closed", "head", "bytes", "transport", "status")

    def __init__(self, first: asyncio.Future[float], closed: asyncio.Future[None]) -> None:
        self.first, self.closed = first, closed
        self.head = b""
        self.bytes = 0
        self.status = 0
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.bytes += len(data)
        if self.first.done():
            return
        self.head += data
        if not self.status and b"\r\n" in self.head:
            try:
                self.status = int(self.head.split(b" ", 2)[1])
            except (IndexError, ValueError):
                self.status = -1
        if b"\ndata: " in self.head:  # the first chunk line of the body
            self.first.set_result(time.monotonic())
            self.head = b""

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self.closed.done():
            self.closed.set_result(None)


async def engine_running(port: int) -> int | None:
    status, body = await http_get(port, "/replay/stats")
    return _decode(body)["running"] if status == 200 else None


async def hold(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    capy, replay = stack.capy, stack.replay
    pid, port, key = stack.pid, capy.port, capy.api_key
    loop = asyncio.get_running_loop()
    expect = (replay.recording / f"{args.case}.sse").read_bytes().count(b"data: ")

    warm = [Record(-1, True, None) for _ in range(8)]
    fast = chat_body(stack.name, args.case, True, 0.0)
    await asyncio.gather(*(one_request(r, port, chat_request(port, key, fast, None), 30, 0, expect) for r in warm))
    if any(r.outcome != "completed" for r in warm):
        bad = next(r for r in warm if r.outcome != "completed")
        raise RuntimeError(f"warm-up failed: {bad.outcome} {bad.status} {bad.code} {bad.detail}\n{capy.log()[-3000:]}")
    await asyncio.sleep(1.0)
    before = {"fds": fd_count(pid), "rss_kb": rss_kb(pid), "breakdown": fd_breakdown(pid, port, replay.port)}

    payload = chat_request(port, key, chat_body(stack.name, args.case, True, args.interval_ms), None)
    firsts: list[asyncio.Future[float]] = [loop.create_future() for _ in range(args.streams)]
    closes: list[asyncio.Future[None]] = [loop.create_future() for _ in range(args.streams)]
    conns = [_Held(f, c) for f, c in zip(firsts, closes, strict=False)]
    gate = asyncio.Semaphore(args.connect_at_once)
    connect_errors: list[str] = []

    async def open_one(conn: _Held) -> None:
        async with gate:
            try:
                transport, _ = await loop.create_connection(lambda: conn, HOST, port)
                transport.write(payload)
            except OSError as exc:
                connect_errors.append(str(exc))

    with Sampler(pid) as sampler:
        began = time.monotonic()
        await asyncio.gather(*(open_one(c) for c in conns))
        connected = time.monotonic() - began
        pending = [f for f in firsts if not f.done()]
        if pending:
            await asyncio.wait(pending, timeout=max(0.0, args.open_timeout - (time.monotonic() - began)))
        opened = sum(f.done() for f in firsts)
        all_open_s = max((f.result() for f in firsts if f.done()), default=began) - began
        at_open = {
            "fds": fd_count(pid),
            "rss_kb": rss_kb(pid),
            "breakdown": fd_breakdown(pid, port, replay.port),
            "engine_running": await engine_running(replay.port),
        }
        await asyncio.sleep(args.hold)
        ended_early = sum(c.done() for c in closes)
        sampler.take()
        during = {"fds": sampler.peak_fds, "rss_kb": sampler.peak_rss_kb, "samples": sampler.samples}
    for conn in conns:
        if conn.transport is not None:
            conn.transport.abort()
    hung_up = time.monotonic()
    alive = stack.capy_alive()
    settled = await settle(pid, args.settle) if alive else 0.0
    after = (
        {
            "fds": fd_count(pid),
            "rss_kb": rss_kb(pid),
            "breakdown": fd_breakdown(pid, port, replay.port),
            "settle_s": round(settled, 1),
            "engine_running": await engine_running(replay.port),
        }
        if alive
        else None
    )
    engine_after = (await http_get(replay.port, "/replay/stats"))[1]
    status_codes: dict[str, int] = {}
    for c in conns:
        status_codes[str(c.status)] = status_codes.get(str(c.status), 0) + 1

    def mb(kb: int) -> float:
        return round(kb / 1024, 1)

    rss_during = mb(during["rss_kb"])
    ok = alive and opened == args.streams and not ended_early and not connect_errors and rss_during <= args.max_rss_mb
    return {
        "config": {
            "streams": args.streams,
            "interval_ms": args.interval_ms,
            "hold_s": args.hold,
            "case": args.case,
            "max_rss_mb": args.max_rss_mb,
            "cores": os.cpu_count(),
            "rlimit_nofile": list(resource.getrlimit(resource.RLIMIT_NOFILE)),
        },
        "opened": opened,
        "connect_errors": len(connect_errors),
        "connect_error_example": connect_errors[0] if connect_errors else None,
        "ended_early": ended_early,
        "statuses": status_codes,
        "connect_s": round(connected, 2),
        "all_first_events_s": round(all_open_s, 2),
        "capyctl": {
            "pid": pid,
            "alive": alive,
            "rss_mb": {
                "before": mb(before["rss_kb"]),
                "during": rss_during,
                "after": mb(after["rss_kb"]) if after else None,
            },
            "fds": {"before": before["fds"], "during": during["fds"], "after": after["fds"] if after else None},
            "per_stream_kb": round((during["rss_kb"] - before["rss_kb"]) / max(args.streams, 1), 1),
            "fds_per_stream": round((during["fds"] - before["fds"]) / max(args.streams, 1), 2),
            "breakdown": {
                "before": before["breakdown"],
                "all_open": at_open["breakdown"],
                "after": after["breakdown"] if after else None,
            },
            "samples": during["samples"],
            "settle_s": after["settle_s"] if after else None,
        },
        "engine_running": {"all_open": at_open["engine_running"], "after": after["engine_running"] if after else None},
        "engine_stats_after": {k: v for k, v in _decode(engine_after).items() if k != "last_request"}
        if engine_after
        else None,
        "settled_after_hang_up_s": round(time.monotonic() - hung_up, 1),
        "ok": ok,
    }


def print_summary(s: dict[str, Any]) -> None:
    c, p = s["config"], s["capyctl"]
    print(
        f"streams: {c['streams']} streams held open, one event every {c['interval_ms']} ms, held {c['hold_s']} s "
        f"after the last first event; case {c['case']}; {c['cores']} cores; RLIMIT_NOFILE {c['rlimit_nofile']}"
    )
    print(
        f"opened {s['opened']}/{c['streams']} (first event on every one within {s['all_first_events_s']} s, "
        f"connections made in {s['connect_s']} s); connect errors {s['connect_errors']}"
        f"{' (' + s['connect_error_example'] + ')' if s['connect_error_example'] else ''}; "
        f"ended early {s['ended_early']}; statuses {s['statuses']}"
    )
    print(f"CapyCTL pid {p['pid']} {'running' if p['alive'] else 'NOT RUNNING (crashed)'}")
    print(f"  {'':8}{'before':>10}{'during':>10}{'after':>10}")
    r, f = p["rss_mb"], p["fds"]
    print(
        f"  {'RSS MB':<8}{r['before']:>10}{r['during']:>10}{str(r['after']):>10}   "
        f"{p['per_stream_kb']} KB per stream (peak of {p['samples']} samples)"
    )
    print(
        f"  {'fds':<8}{f['before']:>10}{f['during']:>10}{str(f['after']):>10}   "
        f"{p['fds_per_stream']} per stream; settle {p['settle_s']} s"
    )
    for when in ("before", "all_open", "after"):
        if p["breakdown"][when]:
            print(f"  {when.replace('_', ' ') + ':':<10}{describe_fds(p['breakdown'][when])}")
    e = s["engine_running"]
    print(
        f"replay engine running streams: {e['all_open']} with all open, {e['after']} after the hang-up; "
        f"its /replay/stats at the end: {s['engine_stats_after']}"
    )
    print("verdict: " + ("OK" if s["ok"] else "FAIL") + f" (RSS during {r['during']} MB, limit {c['max_rss_mb']} MB)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=1000, help="streams to hold open at once (default 1000)")
    parser.add_argument(
        "--interval-ms",
        type=float,
        default=500.0,
        help="the engine's wait before the first event and between events (default 500)",
    )
    parser.add_argument(
        "--hold",
        type=float,
        default=5.0,
        help="seconds to keep them all open once every one has its first event (default 5)",
    )
    parser.add_argument(
        "--open-timeout",
        type=float,
        default=60.0,
        help="at most this many seconds for every stream to get its first event (default 60)",
    )
    parser.add_argument(
        "--connect-at-once", type=int, default=200, help="connections being opened at the same time (default 200)"
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=20.0,
        help="at most this many seconds to wait for CapyCTL's fds to stop falling (default 20)",
    )
    parser.add_argument(
        "--max-rss-mb", type=float, default=300.0, help="fail when CapyCTL's RSS during is above this (default 300)"
    )
    parser.add_argument("--recording", type=Path, default=RECORDING, help="recording folder (default vllm/0.32.0)")
    parser.add_argument("--case", default="chat_stream_usage", help="case every stream asks for")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    args = parser.parse_args()
    if args.streams < 1 or args.connect_at_once < 1:
        parser.error("--streams and --connect-at-once must be >= 1")
    soft, hard = raise_fd_limit()
    if soft < 2 * args.streams + 100:
        print(
            f"warning: RLIMIT_NOFILE is {soft}; {args.streams} streams need about {2 * args.streams + 100} "
            "fds in CapyCTL",
            file=sys.stderr,
        )
    # every stream at the engine at once: slots and queue sized for them, not the defaults (32 in flight)
    config = (
        f"queue:\n  max_in_flight_per_instance: {args.streams}\n"
        f"  max_pending_per_deployment: {args.streams}\n  max_pending_total: {args.streams}\n"
    )
    return run_bench("streams", args, hold, print_summary, config=config)


if __name__ == "__main__":
    entry(main)
