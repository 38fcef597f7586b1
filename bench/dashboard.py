"""Dashboard benchmark: page times with a big fleet, the memory of open event streams, and the relay with
dashboards open, against one real CapyCTL in one run.

    python bench/dashboard.py [--deployments 100] [--records 10000] [--samples 30] [--streams 50]
                              [--dashboards 5] [--rounds 4] [--seconds 2] [--paced 80] [--python PYTHON]

The server gets ``--deployments`` deployments: one attached to the replay
engine (the relayed one) and the others stand-in vLLM engines, host_backed,
4 GiB awake and 1 GiB parked on one 64 GiB device, five of them started (so the
Memory page stacks five and works out, with the domain's ``plan``, what each
of the others would take). Its request records are filled with ``--records``
rows spread over the last 24 hours before it starts.

1. Each page (and the charts' data for each window) is fetched ``--samples``
   times, one after the other over one kept-alive connection, signed in: p50
   and p95 of the whole answer as the client saw it (so the server's own time
   is at most this), against the 50 ms target.
2. ``--streams`` live streams are opened (the five live pages in turn), each
   read until its first full picture arrived; the server's RSS before and
   with them open, against the 20 MB target.
3. The relay line with and without ``--dashboards`` dashboards open (a child
   process keeps one live stream per live page open and reads it), in
   alternating rounds so a noisy machine hurts both alike (the quiet half runs
   the same child with no stream open): time to first token added by CapyCTL
   at one stream (engine at its recorded pace; direct in the same rounds) and
   CapyCTL's CPU per relayed chunk at 32 streams (the server process's own
   CPU, dashboards' work included). ``--dashboards 0`` makes it an A/A run:
   the spread it shows is the method's own noise.
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
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.relay import _LISTENING, Route, cpu_seconds, measure, paced_ttft, pct, pooled  # noqa: E402
from capyctl.adapters.storage.sqlite import SqliteStore  # noqa: E402
from capyctl.adapters.storage.state_dir import StateDir  # noqa: E402
from capyctl.domain.request_rows import RequestRow  # noqa: E402
from tests.fakes.standin_venv import make_standin_venv  # noqa: E402
from tests.integration.harness import CapyServer  # noqa: E402

LIVE = ("fleet", "memory", "requests", "keys", "events")  # the pages with a live stream
PAGE_TARGET_MS = 50.0
STREAMS_TARGET_MB = 20.0
RELAYED = "bench"


def fill_records(state: Path, count: int, names: list[str], now: float) -> str:
    """``count`` rows over the last 24 hours, most of them answers with figures; returns one row's ID."""
    rng = random.Random(7)
    StateDir(state).prepare()
    store = SqliteStore(StateDir(state).database)
    rows = []
    for n in range(count):
        at = now - 86400 * (count - n) / count
        name = names[n % len(names)]
        refused = rng.random() < 0.05
        rows.append(
            RequestRow(
                id=f"01BENCH{n:019d}",
                at=at,
                api="chat",
                code="queue_full" if refused else "ok",
                status=429 if refused else 200,
                deployment=name,
                key="default",
                instance=None if refused else 0,
                stream=bool(n % 2),
                total_ms=None if refused else rng.uniform(200, 4000),
                queue_wait_ms=rng.uniform(0, 50),
                ttft_ms=None if refused else rng.uniform(20, 400),
                queue_ms=None if refused else rng.uniform(0, 5),
                prefill_ms=None if refused else rng.uniform(5, 100),
                decode_tokens_per_second=None if refused else rng.uniform(20, 90),
                prompt_tokens=None if refused else rng.randint(10, 2000),
                cached_tokens=None if refused else 0,
                completion_tokens=None if refused else rng.randint(1, 500),
            )
        )
    try:
        store.add_requests(rows)  # type: ignore[arg-type]
    finally:
        store.close()
    return rows[-1].id


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def admin(server: CapyServer) -> httpx.Client:
    token = (server.state_dir / "identity" / "admin-token").read_text().strip()
    return httpx.Client(
        base_url=f"http://127.0.0.1:{server.management_port}", timeout=60, headers={"authorization": f"Bearer {token}"}
    )


def signed_in(server: CapyServer) -> httpx.Client:
    """A client holding a dashboard session, from the one-time link `capyctl dashboard` prints."""
    link = server.cli("dashboard").stdout.strip()
    client = httpx.Client(timeout=60, follow_redirects=True)
    answer = client.get(link)
    answer.raise_for_status()
    assert client.cookies, f"no session cookie after the sign-in link: {answer.status_code}"
    return client


def time_pages(client: httpx.Client, origin: str, urls: list[str], samples: int) -> list[tuple[str, float, float]]:
    out = []
    for url in urls:
        times = []
        for i in range(samples + 3):  # three to warm it
            began = time.perf_counter()
            answer = client.get(origin + url)
            took = time.perf_counter() - began
            if answer.status_code != 200:
                raise SystemExit(f"{url} answered {answer.status_code}: {answer.text[:300]}")
            if i >= 3:
                times.append(took * 1000)
        out.append((url, statistics.median(times), pct(times, 0.95) / 1000))  # pct gives seconds as ms
    return out


async def open_streams(
    port: int, cookie: str, pages: list[str], ready: asyncio.Event | None = None, hold: asyncio.Event | None = None
) -> list[int]:
    """Open one stream per entry of ``pages``, read each until its first full picture arrived (no more bytes
    for 0.3 s after an event), then hold them open, reading, until ``hold`` is set; bytes read per stream."""
    got = [0] * len(pages)
    first = [asyncio.Event() for _ in pages]

    async def one(i: int, page: str) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            f"GET /ui/stream?page={page} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nCookie: {cookie}\r\n"
            f"Accept: text/event-stream\r\n\r\n".encode()
        )
        head = await reader.readuntil(b"\r\n\r\n")
        if b" 200 " not in head.split(b"\r\n", 1)[0]:
            raise SystemExit(f"the {page} stream was refused: {head[:200]!r}")
        seen = b""
        try:
            while True:
                try:
                    data = await asyncio.wait_for(reader.read(65536), 0.3 if not first[i].is_set() else None)
                except TimeoutError:
                    if b"event:" in seen:
                        first[i].set()
                    continue
                if not data:
                    raise SystemExit(f"the {page} stream ended")
                got[i] += len(data)
                if not first[i].is_set():
                    seen += data
        finally:
            writer.close()

    tasks = [asyncio.create_task(one(i, page)) for i, page in enumerate(pages)]
    try:
        waiting = asyncio.gather(*(f.wait() for f in first))
        done, _ = await asyncio.wait(
            [asyncio.ensure_future(waiting), *tasks], timeout=60, return_when=asyncio.FIRST_COMPLETED
        )
        for task in tasks:
            if task in done:
                task.result()  # raises what ended it
        if not all(f.is_set() for f in first):
            raise SystemExit("the streams did not all send their first picture within 60 s")
        if ready is not None:
            ready.set()
        if hold is not None:
            await hold.wait()
        return got
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def watch(port: int, cookie: str, count: int) -> None:
    """The child process of part 3: ``count`` dashboards' streams held open and read until killed."""
    pages = [LIVE[i % len(LIVE)] for i in range(count)]

    async def main() -> None:
        ready = asyncio.Event()
        hold = asyncio.Event()
        task = asyncio.create_task(open_streams(port, cookie, pages, ready, hold))
        await ready.wait()
        print(f"watching {count}", flush=True)
        await task

    asyncio.run(main())


class Watchers:
    """``count`` dashboards open in a child process, for as long as the ``with`` lasts."""

    def __init__(self, port: int, cookie: str, count: int) -> None:
        self.args = [sys.executable, __file__, "--watch", str(port), cookie, str(count)]
        self.process: subprocess.Popen[str] | None = None

    def __enter__(self) -> Watchers:
        self.process = subprocess.Popen(self.args, stdout=subprocess.PIPE, text=True)
        line = self.process.stdout.readline()  # type: ignore[union-attr]
        if not line.startswith("watching"):
            raise SystemExit(f"the dashboards did not open: {line!r}")
        return self

    def __exit__(self, *_: object) -> None:
        assert self.process is not None
        self.process.kill()
        self.process.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deployments", type=int, default=100)
    parser.add_argument("--records", type=int, default=10_000)
    parser.add_argument("--samples", type=int, default=30, help="fetches per page")
    parser.add_argument("--streams", type=int, default=50, help="live streams open at once for the RSS figure")
    parser.add_argument("--dashboards", type=int, default=5, help="dashboards open during the relay's loaded half")
    parser.add_argument("--rounds", type=int, default=4, help="alternations of quiet and watched for the relay line")
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds of load at 32 streams per half-round")
    parser.add_argument("--paced", type=int, default=80, help="paced first-token streams per path and half")
    parser.add_argument(
        "--python",
        default=sys.executable,
        help="the interpreter that runs CapyCTL (another tree's venv, or a wrapper that profiles it)",
    )
    parser.add_argument("--watch", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.watch:
        watch(int(args.watch[0]), args.watch[1], int(args.watch[2]))
        return
    if args.deployments < 7:
        parser.error("--deployments must be 7 or more (one relayed, five started, one stopped at least)")
    if not 1 <= args.streams <= 60:
        parser.error("--streams must be within 1..60 (the server keeps 64 streams open at most)")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    recording = ROOT / "tests/contract/recordings/vllm/0.32.0"
    case = "chat_stream_usage"
    tmp = Path(tempfile.mkdtemp(prefix="capyctl-dashbench-"))
    (tmp / "model").mkdir()
    names = [RELAYED] + [f"d{i:03d}" for i in range(args.deployments - 1)]
    last_id = fill_records(tmp / "state", args.records, names, time.time())
    config = tmp / "server.yaml"
    config.write_text(
        "memory:\n  devices:\n    - name: gpu0\n      capacity: 64GiB\n      reserve: 1GiB\n"
        "queue:\n  max_in_flight_per_instance: 64\n  max_pending_per_deployment: 64\n"
        "  max_pending_total: 256\n"
    )
    replay = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "capyctl.replay",
            "--dialect",
            "vllm",
            "--version",
            "0.32.0",
            "--recordings",
            str(recording),
            "--port",
            "0",
            "--pace",
            "fast",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    server = CapyServer(tmp / "state", "--config", str(config), python=args.python)
    try:
        match = _LISTENING.search(replay.stdout.readline().decode())  # type: ignore[union-attr]
        assert match, "the replay engine did not start"
        rhost, rport = match.group(1), int(match.group(2))
        server.start()
        pid = server.process.pid  # type: ignore[union-attr]
        origin = f"http://127.0.0.1:{server.management_port}"
        venv = make_standin_venv(tmp / "vllm-venv", "vllm", "0.32.0")
        server.cli("engine", "add", str(venv), "--name", "vllm")
        with admin(server) as api:
            began = time.perf_counter()
            relayed = {
                "name": RELAYED,
                "engine": "vllm",
                "endpoint": f"http://{rhost}:{rport}",
                "engine_version": "0.32.0",
            }
            api.put("/deployments", json={"document": relayed}).raise_for_status()
            for name in names[1:]:
                api.put(
                    "/deployments",
                    json={
                        "document": {
                            "name": name,
                            "engine": "vllm",
                            "model": str(tmp / "model"),
                            "residency": "host_backed",
                            "resources": {"memory": "4GiB", "parked_memory": "1GiB"},
                        }
                    },
                ).raise_for_status()
            for name in names[1:6]:
                api.post(f"/deployments/{name}/start").raise_for_status()
            deadline = time.monotonic() + 120
            while any(api.get(f"/deployments/{n}").json()["state"] != "ready" for n in names[1:6]):
                if time.monotonic() > deadline:
                    raise SystemExit("five started deployments were not ready within 120 s")
                time.sleep(0.2)
            print(
                f"dashboard benchmark: {os.cpu_count()} cores; {len(names)} deployments (1 relayed, "
                f"{len(names) - 1} stand-in vLLM, 5 started) made in {time.perf_counter() - began:.1f} s; "
                f"{args.records:,} request records over 24 h"
            )

        client = signed_in(server)
        cookie = "; ".join(f"{k}={v}" for k, v in client.cookies.items())
        urls = [
            "/ui/",
            "/ui/memory",
            "/ui/requests",
            f"/ui/requests/{last_id}",
            "/ui/charts",
            "/ui/charts/data?window=15m",
            "/ui/charts/data?window=1h",
            "/ui/charts/data?window=24h",
            "/ui/keys",
            "/ui/events",
            f"/ui/deployments/{names[10]}/start",
            f"/ui/deployments/{names[1]}/park",
        ]
        print(
            f"\n1. page answers, {args.samples} fetches each (whole answer as the client saw it; "
            f"target p50 <= {PAGE_TARGET_MS:g} ms)"
        )
        print(f"   {'page':<44} {'p50 ms':>8} {'p95 ms':>8}")
        worst = 0.0
        for url, p50, p95 in time_pages(client, origin, urls, args.samples):
            worst = max(worst, p50)
            print(f"   {url:<44} {p50:>8.2f} {p95:>8.2f}{'' if p50 <= PAGE_TARGET_MS else '  OVER'}")
        print(f"   slowest p50: {worst:.2f} ms -> {'met' if worst <= PAGE_TARGET_MS else 'NOT met'}")

        before = rss_bytes(pid)
        pages = [LIVE[i % len(LIVE)] for i in range(args.streams)]
        with_streams: list[int] = []

        async def streams_open() -> list[int]:
            ready, hold = asyncio.Event(), asyncio.Event()
            task = asyncio.create_task(open_streams(server.management_port, cookie, pages, ready, hold))
            await ready.wait()
            await asyncio.sleep(1.0)  # a second of live ticks with all of them open
            with_streams.append(rss_bytes(pid))
            hold.set()
            return await task

        got = asyncio.run(streams_open())
        added = (with_streams[0] - before) / 2**20
        print(
            f"\n2. {args.streams} live streams open ({', '.join(LIVE)} in turn; {sum(got) / 1024:.0f} KiB read): "
            f"server RSS {before / 2**20:.1f} -> {with_streams[0] / 2**20:.1f} MiB, added {added:.1f} MiB "
            f"(target < {STREAMS_TARGET_MB:g}) -> {'met' if added < STREAMS_TARGET_MB else 'NOT met'}"
        )

        body = b'{"model":"%s","stream":true,"replay_case":"%s","messages":[{"role":"user","content":"hi"}]}' % (
            RELAYED.encode(),
            case.encode(),
        )
        plain = body.replace(b'"%s"' % RELAYED.encode(), b'"x"')
        expect = (recording / f"{case}.sse").read_bytes().count(b"data: ")
        routes = {
            "quiet": Route("quiet", "127.0.0.1", server.port, body, server.api_key, lambda: cpu_seconds(pid)),
            "watched": Route("watched", "127.0.0.1", server.port, body, server.api_key, lambda: cpu_seconds(pid)),
        }
        paced: dict[str, list[float]] = {"quiet": [], "watched": [], "direct quiet": [], "direct watched": []}
        per_half = max(1, args.paced // args.rounds)
        for round_ in range(args.rounds):
            for half in ("quiet", "watched") if round_ % 2 == 0 else ("watched", "quiet"):
                # the quiet half runs the same child with no stream open: the halves differ by the streams only
                count = args.dashboards if half == "watched" else 0
                with Watchers(server.management_port, cookie, count):
                    measure(routes[half], 32, args.seconds, expect)
                    for _ in range(per_half):
                        paced[f"direct {half}"].append(
                            asyncio.run(paced_ttft(rhost, rport, plain[:-1] + b',"replay_pace":"recorded"}', None))
                        )
                        paced[half].append(
                            asyncio.run(
                                paced_ttft(
                                    "127.0.0.1", server.port, body[:-1] + b',"replay_pace":"recorded"}', server.api_key
                                )
                            )
                        )
        print(f"\n3. relay line without and with {args.dashboards} dashboards open ({args.rounds} alternating rounds)")
        line = {}
        for half in ("quiet", "watched"):
            p = pooled(routes[half].rounds[32])
            added_ms = pct(paced[half], 0.5) - pct(paced[f"direct {half}"], 0.5)  # pct: seconds in, ms out
            cpu_us = p["cpu"] / p["chunks"] * 1e6
            line[half] = (added_ms, cpu_us)
            print(
                f"   {half:<8} added first token p50 {added_ms:.3f} ms ({len(paced[half])} paced streams), "
                f"CPU per chunk at 32 streams {cpu_us:.2f} µs ({p['chunks']:,} chunks)"
            )
        (qa, qc), (wa, wc) = line["quiet"], line["watched"]
        print(
            f"   watched - quiet: first token {wa - qa:+.3f} ms, CPU per chunk {wc - qc:+.2f} µs "
            f"({(wc / qc - 1) * 100:+.1f} %)"
        )
    finally:
        server.stop()
        replay.terminate()
        replay.wait(10)


if __name__ == "__main__":
    main()
