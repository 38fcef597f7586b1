"""Relay benchmark: N concurrent streams straight to the replay engine, through nginx and through CapyCTL, in one run.

    python bench/relay.py [--recording tests/contract/recordings/vllm/0.32.0] [--case chat_stream_usage]
                          [--concurrency 1,16,64,256] [--seconds 3] [--rounds 2] [--nginx PATH]

The replay engine serves a recorded real stream at full speed. For each N the
paths are measured in alternating rounds (direct, nginx, relayed; the next
round starts one path later) so a noisy machine hurts all alike. Printed per N:
time to first chunk p50/p99 of each path and the added median, chunks per
second of each path and their ratio to direct, and the proxy's CPU seconds per
1,000 relayed chunks (from /proc, read before and after each load: the proxy's
own cost even when the client is the bottleneck). At the end a table of
medians over the rounds: added time to first token at one stream (engine at
its recorded pace; added = path minus direct in the same round), chunks/s and
CPU µs per chunk at each N, and the ratios CapyCTL/nginx.

With --baseline PYTHON one more CapyCTL is measured beside this one, in the same rounds: the one that
PYTHON runs (e.g. another checkout's .venv/bin/python), as "capyctl@base", with its hang-ups timed too:
a before and after of two trees in one run.
With --floor a fourth path is measured: bench/bare_relay.py --decode, a relay in Python with none of
CapyCTL's features that only decodes each chunk (the floor of a checking relay in Python here).
With --floor-checks one more: bench/bare_relay.py --decode --checks, the same relay doing the least of
CapyCTL's front per request (a ULID, the key's digest, the body's decode, a place under a limit, the
model's name in the engine's body) in flat code.

nginx is Debian's nginx-light (apt-get install nginx-light), started by the
bench as its child with a generated config (one worker, on a free loopback
port, prefix in a temp dir); without it the nginx path is skipped.
Figures are ratios against the direct baseline measured in the same run. With --paced, one more line
gives this machine's own cost of a hop for scale: a one-byte round trip over loopback between two idle
processes (a relay adds one hop each way to the first token, nginx too); added first-token times of
different machines compare only beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.harness import CapyServer, free_port  # noqa: E402

_LISTENING = re.compile(r"listening on http://([\d.]+):(\d+)")


def request(host: str, body: bytes, key: str | None) -> bytes:
    """A streamed chat request, as raw bytes (a lean client, the same for both paths)."""
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n{auth}Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


class Dechunk:
    """Incremental HTTP/1.1 chunked-body decoder: feed the bytes as read, get the payload back.

    Needed since nginx re-chunks what it relays at its own read boundaries: a chunk-size line can fall
    inside "data: ", which a count over the raw bytes would miss. Every path's body goes through it alike.
    """

    def __init__(self) -> None:
        self.pending = b""  # an incomplete size line
        self.left = 0  # payload bytes still due in the current chunk
        self.skip = 0  # bytes of the CRLF after a chunk's payload still to drop
        self.done = False

    def feed(self, data: bytes) -> bytes:
        if self.pending:
            data, self.pending = self.pending + data, b""
        out = []
        i, size = 0, len(data)
        while i < size and not self.done:
            if self.skip:
                step = min(self.skip, size - i)
                self.skip -= step
                i += step
            elif self.left:
                piece = data[i : i + self.left]
                out.append(piece)
                self.left -= len(piece)
                i += len(piece)
                if not self.left:
                    self.skip = 2
            else:
                end = data.find(b"\r\n", i)
                if end < 0:
                    self.pending = data[i:]
                    break
                self.left = int(data[i:end].split(b";", 1)[0], 16)
                i = end + 2
                self.done = self.left == 0
        return b"".join(out)


async def one_stream(host: str, port: int, body: bytes, key: str | None) -> tuple[float, int]:
    """(seconds to the first data chunk, data chunks received) for one streamed request."""
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(request(host, body, key))
    first = 0.0
    chunks = 0
    head = await reader.readuntil(b"\r\n\r\n")
    dechunk = Dechunk().feed if b"transfer-encoding: chunked" in head.lower() else None
    tail = b""
    while data := await reader.read(65536):
        if dechunk:
            data = dechunk(data)
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


async def first_data(reader: asyncio.StreamReader) -> None:
    """Read until the first data event; an answer that ends before one is the bench's error, not a wait."""
    seen = b""
    while b"data: " not in seen:
        data = await reader.read(65536)
        if not data:
            raise SystemExit(f"the stream ended before its first data event: {seen[:300]!r}")
        seen += data


async def hang_up_delay(host: str, port: int, body: bytes, key: str | None, stats_url: str) -> float:
    """Seconds from a client hang-up to the engine seeing its connection closed (polled on /replay/stats)."""
    import httpx

    async with httpx.AsyncClient() as client:
        before = (await client.get(stats_url)).json()["disconnected"]
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(request(host, body, key))
        await first_data(reader)
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
    await first_data(reader)
    first = time.perf_counter() - started
    writer.transport.abort()
    await asyncio.sleep(0.02)  # let both sides finish with the cut stream before the next one
    return first


_ECHO = """
import socket, sys
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(1)
print(s.getsockname()[1], flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (d := c.recv(64)):
    c.sendall(d)
"""


def loopback_round_trip(count: int = 200, pause: float = 0.005) -> float:
    """Median µs of a one-byte round trip over loopback TCP to another process, ``pause`` s apart: what
    one hop there and back costs on this machine when both ends have idled (as for a paced first token),
    whatever the program. A relay puts two more hops on the way to the first token."""
    echo = subprocess.Popen([sys.executable, "-c", _ECHO], stdout=subprocess.PIPE)
    try:
        port = int(echo.stdout.readline())  # type: ignore[union-attr]
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            trips = []
            for _ in range(count):
                began = time.perf_counter()
                sock.sendall(b"x")
                sock.recv(64)
                trips.append((time.perf_counter() - began) * 1e6)
                time.sleep(pause)
        return statistics.median(trips)
    finally:
        echo.kill()
        echo.wait(10)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> list[int]:
    """``pid`` and every process below it (nginx: the master and its worker), from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry.name}/stat").read_text().rsplit(") ", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            children.setdefault(ppid, []).append(int(entry.name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def tree_cpu_seconds(pid: int) -> float:
    """user+system CPU seconds of ``pid`` and its descendants alive now."""
    total = 0.0
    for one in process_tree(pid):
        with contextlib.suppress(OSError, IndexError, ValueError):  # exited between the listing and the read
            total += cpu_seconds(one)
    return total


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


def find_nginx() -> str | None:
    found = shutil.which("nginx")
    if found:
        return found
    return "/usr/sbin/nginx" if os.access("/usr/sbin/nginx", os.X_OK) else None


# The nginx a careful operator would put in front of an SSE engine: HTTP/1.1 to the engine with pooled
# keep-alive connections (Connection "" so the client's "close" is not passed on), no response buffering
# (each chunk leaves as it arrives), no access log (CapyCTL's relay keeps none per chunk either).
# worker_processes 1: CapyCTL relays from one process, so nginx gets one worker too (and its master, which
# is idle while relaying; its CPU is counted all the same).
# what every nginx of the benches sets in its http block: no access log, its temp folders in its prefix
NGINX_HTTP_BASICS = """\
    access_log off;
    client_body_temp_path {prefix}/client_body;
    proxy_temp_path {prefix}/proxy;
    fastcgi_temp_path {prefix}/fastcgi;
    uwsgi_temp_path {prefix}/uwsgi;
    scgi_temp_path {prefix}/scgi;
"""

NGINX_CONF = """\
# generated by bench/relay.py for one run
worker_processes 1;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
{user}
events {{
    worker_connections {connections};
}}

http {{
{basics}
    upstream engine {{
        server {engine_host}:{engine_port};
        keepalive {keepalive};
    }}

    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


class Nginx:
    """nginx in the foreground as a child process (daemon off; master + one worker), prefix in a temp dir."""

    def __init__(self, binary: str, engine_host: str, engine_port: int, streams: int) -> None:
        self.binary = binary
        self.prefix = Path(tempfile.mkdtemp(prefix="capyctl-bench-nginx-"))
        self.port = free_port()
        self.conf = self.prefix / "nginx.conf"
        self.conf.write_text(
            NGINX_CONF.format(
                prefix=self.prefix,
                basics=NGINX_HTTP_BASICS.format(prefix=self.prefix),
                port=self.port,
                engine_host=engine_host,
                engine_port=engine_port,
                keepalive=max(32, streams),  # every stream's engine connection can go back to the pool
                connections=max(1024, 4 * streams),  # a client and an engine connection per stream, plus idle ones
                # as root the worker would switch to nobody; the prefix is root's own (mode 0700), so keep root
                user="user root;" if os.geteuid() == 0 else "",
            )
        )
        self.process: subprocess.Popen[bytes] | None = None
        self.workers: set[int] = set()

    def log(self) -> str:
        path = self.prefix / "error.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def start(self, timeout: float = 10.0) -> Nginx:
        import httpx

        with open(self.prefix / "stdout.log", "ab") as out:
            self.process = subprocess.Popen(
                [
                    self.binary,
                    "-p",
                    str(self.prefix),
                    "-e",
                    str(self.prefix / "error.log"),
                    "-c",
                    str(self.conf),
                    "-g",
                    "daemon off;",
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nginx exited with {self.process.returncode}: {self.log().strip()}")
            try:  # an answer relayed from the engine: the worker is up and reaches the upstream
                if httpx.get(f"http://127.0.0.1:{self.port}/replay/stats", timeout=1).status_code == 200:
                    self.workers = set(process_tree(self.process.pid)) - {self.process.pid}
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"nginx did not answer in {timeout} s: {self.log().strip()}")

    def cpu(self) -> float:
        assert self.process is not None
        return tree_cpu_seconds(self.process.pid)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()  # SIGTERM: nginx's fast shutdown, the worker goes with it
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        for pid in self.workers:  # a worker outliving a killed master: by its own id, if still nginx
            try:
                if Path(f"/proc/{pid}/exe").resolve() == Path(self.binary).resolve():
                    os.kill(pid, signal.SIGKILL)
            except OSError:
                pass  # gone, as it should be
        shutil.rmtree(self.prefix, ignore_errors=True)


@dataclass
class Route:
    """One way to the engine: straight, through nginx or through CapyCTL."""

    name: str
    host: str
    port: int
    body: bytes
    key: str | None
    cpu: Callable[[], float] | None = None  # the proxy's own CPU seconds so far; None: no proxy
    rounds: dict[int, list[dict]] = field(default_factory=dict)  # N -> one load() result (+ "cpu") per round
    paced: list[list[float]] = field(default_factory=list)  # paced first-token seconds, one list per round


def measure(route: Route, n: int, seconds: float, expect: int) -> dict:
    """One load on one route; the proxy's CPU read just before and just after it."""
    before = route.cpu() if route.cpu else 0.0
    got = asyncio.run(load(route.host, route.port, route.body, route.key, n, seconds, expect))
    got["cpu"] = route.cpu() - before if route.cpu else 0.0
    route.rounds.setdefault(n, []).append(got)
    return got


def rotated(routes: list[Route], round_: int) -> list[Route]:
    """The routes in order, starting one later each round: no path is always first after the previous one."""
    k = round_ % len(routes)
    return routes[k:] + routes[:k]


def pooled(results: list[dict]) -> dict:
    return {
        "ttfts": [t for r in results for t in r["ttfts"]],
        "chunks": sum(r["chunks"] for r in results),
        "elapsed": sum(r["elapsed"] for r in results),
        "cpu": sum(r["cpu"] for r in results),
    }


def summary(routes: list[Route], ns: list[int], ttft_rounds: Callable[[Route], list[list[float]]], source: str) -> None:
    """Medians over the rounds per path; added TTFT is path minus direct within each round."""
    direct = routes[0]
    rows: dict[str, list[float | None]] = {}
    for route in routes:
        row: list[float | None] = []
        rounds = zip(ttft_rounds(route), ttft_rounds(direct), strict=False)
        pairs = [(mine, base) for mine, base in rounds if mine and base]
        for q in (0.5, 0.99):
            if route is direct:
                row.append(None)
            else:
                row.append(statistics.median(pct(mine, q) - pct(base, q) for mine, base in pairs) if pairs else None)
        for n in ns:
            row.append(statistics.median(r["chunks"] / r["elapsed"] for r in route.rounds[n]))
        for n in ns:
            row.append(
                None if route.cpu is None else statistics.median(r["cpu"] / r["chunks"] * 1e6 for r in route.rounds[n])
            )
        rows[route.name] = row

    def cell(value: float | None, width: int, digits: int) -> str:
        return f"{'-' if value is None else f'{value:.{digits}f}':>{width}}"

    ttft_head = "added TTFT p50/p99 ms (1 stream)"
    heads = [f"chunks/s @{n}" if i == 0 else f"@{n}" for i, n in enumerate(ns)]
    heads += [f"CPU µs/chunk @{n}" if i == 0 else f"@{n}" for i, n in enumerate(ns)]
    widths = [max(len(h), 8) for h in heads]
    print(f"{'path':<26} {ttft_head:>33} " + " ".join(f"{h:>{w}}" for h, w in zip(heads, widths, strict=False)))

    def line(label: str, row: list[float | None], ttft_digits: int = 3, digits: list[int] | None = None) -> None:
        ttft = (
            "(baseline)"
            if label == "direct"
            else f"{cell(row[0], 0, ttft_digits).strip()} / {cell(row[1], 0, ttft_digits).strip()}"
        )
        digits = digits or [0] * len(ns) + [1] * len(ns)
        cells = " ".join(cell(v, w, d) for v, w, d in zip(row[2:], widths, digits, strict=False))
        print(f"{label:<26} {ttft:>33} " + cells)

    for name, row in rows.items():
        line(name, row)
    for name, other in (
        ("capyctl", "nginx"),
        ("capyctl", "bare python"),
        ("capyctl@base", "nginx"),
        ("capyctl", "capyctl@base"),
    ):
        if other in rows and name in rows:
            ratio: list[float | None] = []
            for mine, theirs in zip(rows[name], rows[other], strict=False):
                ratio.append(mine / theirs if mine is not None and theirs is not None and theirs > 0.0005 else None)
            line(f"ratio {name}/{other}", ratio, 2, [2] * (2 * len(ns)))
    if "nginx" not in rows:
        print("(no nginx path this run: no capyctl/nginx ratios)")
    print(f"(medians over the rounds; added TTFT: {source}; CPU: the proxy's own processes, /proc utime+stime)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recording", default=str(ROOT / "tests/contract/recordings/vllm/0.32.0"))
    parser.add_argument("--case", default="chat_stream_usage")
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds per path and round")
    parser.add_argument("--rounds", type=int, default=2, help="alternations of direct, nginx and relayed per N")
    parser.add_argument("--hangups", type=int, default=20, help="client hang-ups to time (0: none)")
    parser.add_argument(
        "--handoff",
        type=int,
        default=256,
        help="streams waiting on one slot, to time a freed slot's hand-over to the next (0: none)",
    )
    parser.add_argument(
        "--paced",
        type=int,
        default=60,
        help="streams per path to time to first token with the engine at its recorded pace (0: none)",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also measure bench/bare_relay.py --decode: a featureless Python relay that only decodes "
        "each chunk, the floor of what a relay in Python costs on this machine",
    )
    parser.add_argument(
        "--floor-checks",
        action="store_true",
        help="also measure bench/bare_relay.py --decode --checks: the floor relay doing the least "
        "of CapyCTL's front per request (ULID, key digest, body decode, in-flight limit) in "
        "flat code",
    )
    parser.add_argument(
        "--baseline",
        metavar="PYTHON",
        help="also measure the CapyCTL this interpreter runs (another tree's venv), as capyctl@base",
    )
    parser.add_argument(
        "--nginx",
        default=find_nginx(),
        help="nginx binary for the nginx path (default: nginx on PATH, else /usr/sbin/nginx)",
    )
    args = parser.parse_args()
    if not 0 <= args.handoff <= 1000:
        parser.error("--handoff must be within 0..1000 (the replay engine keeps its last 1,000 idle gaps)")
    if args.rounds < 1:
        parser.error("--rounds must be 1 or more")
    recording = Path(args.recording)
    engine, version = recording.parent.name, recording.name
    ns = [int(x) for x in args.concurrency.split(",")]
    # a plain kill ends the bench through its finally: the engine, CapyCTL and nginx are stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    replay = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "capyctl.replay",
            "--dialect",
            engine,
            "--version",
            version,
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
    tmp = Path(tempfile.mkdtemp(prefix="capyctl-bench-"))
    most = max(ns)
    relay_config = tmp / "relay.yaml"  # every client at the engine at once: this measures the relay, not the queue
    relay_config.write_text(
        f"queue:\n  max_in_flight_per_instance: {most}\n  max_pending_per_deployment: {most}\n"
        f"  max_pending_total: {most}\n"
    )
    capy = CapyServer(tmp / "state", "--config", str(relay_config))
    base = (
        CapyServer(tmp / "base-state", "--config", str(relay_config), python=args.baseline) if args.baseline else None
    )
    nginx: Nginx | None = None
    bare: subprocess.Popen[bytes] | None = None
    checked: subprocess.Popen[bytes] | None = None
    try:
        line = replay.stdout.readline().decode()  # type: ignore[union-attr]
        match = _LISTENING.search(line)
        assert match, f"replay engine did not start: {line}"
        rhost, rport = match.group(1), int(match.group(2))
        deployment = tmp / "bench.yaml"
        deployment.write_text(
            f"name: bench\nengine: {engine}\nendpoint: http://{rhost}:{rport}\nengine_version: {version}\n"
        )
        for server in (capy, base):
            if server is not None:
                server.start()
                server.cli("deploy", "model", "--file", str(deployment))
        body = (
            b'{"model":"bench","stream":true,"replay_case":"%s",'
            b'"messages":[{"role":"user","content":"hi"}]}' % args.case.encode()
        )
        pid = capy.process.pid  # type: ignore[union-attr]
        expect = (recording / f"{args.case}.sse").read_bytes().count(b"data: ")
        plain = body.replace(b'"bench"', b'"x"')  # straight to the engine, or through nginx: no CapyCTL model
        direct = Route("direct", rhost, rport, plain, None)
        capyctl = Route("capyctl", "127.0.0.1", capy.port, body, capy.api_key, lambda: cpu_seconds(pid))
        routes = [direct]
        if not (args.nginx and os.path.isfile(args.nginx) and os.access(args.nginx, os.X_OK)):
            print(
                f"nginx not found ({args.nginx or 'not on PATH, not /usr/sbin/nginx'}): the nginx path is skipped; "
                f"install it with `apt-get install nginx-light` (Debian/Ubuntu) or pass --nginx PATH"
            )
        else:
            nginx = Nginx(args.nginx, rhost, rport, most)
            try:
                nginx.start()
            except (OSError, RuntimeError) as exc:
                print(f"nginx {args.nginx} did not start ({exc}): the nginx path is skipped")
                nginx.stop()
                nginx = None
        if nginx is not None:
            routes.append(Route("nginx", "127.0.0.1", nginx.port, plain, None, nginx.cpu))
        if args.floor:
            bare = subprocess.Popen(
                [sys.executable, str(ROOT / "bench" / "bare_relay.py"), rhost, str(rport), "--decode"],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            match = _LISTENING.search(bare.stdout.readline().decode())  # type: ignore[union-attr]
            assert match, "bench/bare_relay.py did not start"
            routes.append(
                Route("bare python", "127.0.0.1", int(match.group(2)), plain, None, lambda: cpu_seconds(bare.pid))
            )
        if args.floor_checks:
            key = "capy_" + "k" * 52
            checked = subprocess.Popen(
                [sys.executable, str(ROOT / "bench" / "bare_relay.py"), rhost, str(rport), "--decode", "--checks", key],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
            )
            match = _LISTENING.search(checked.stdout.readline().decode())  # type: ignore[union-attr]
            assert match, "bench/bare_relay.py --checks did not start"
            routes.append(
                Route("python + checks", "127.0.0.1", int(match.group(2)), plain, key, lambda: cpu_seconds(checked.pid))
            )
        if base is not None:
            base_pid = base.process.pid  # type: ignore[union-attr]
            routes.append(
                Route("capyctl@base", "127.0.0.1", base.port, body, base.api_key, lambda: cpu_seconds(base_pid))
            )
        routes.append(capyctl)
        for route in routes:  # warm each path (connections, first-use code paths) before anything is measured
            asyncio.run(load(route.host, route.port, route.body, route.key, 1, 0.2, expect))

        print(
            f"relay benchmark: {engine} {version} case {args.case}, {os.cpu_count()} cores, "
            f"{args.rounds}x{args.seconds:g} s per path and N"
        )
        if nginx is not None:
            print(
                f"nginx path: {args.nginx} ({nginx_version(args.nginx)}), 1 worker, keepalive to the engine, "
                f"proxy_buffering off; its columns follow CapyCTL's on each line"
            )
            extra = f" {'ttft p50 nginx':>15} {'chunks/s nginx':>15} {'ratio':>6} {'CPU s/1k nginx':>15}"
        else:
            extra = ""
        print(
            f"{'N':>4} {'ttft p50 direct/relay ms':>26} {'added p50':>10} {'ttft p99 direct/relay ms':>26} "
            f"{'chunks/s direct':>16} {'relay':>10} {'ratio':>6} {'CPU s/1k chunks':>16}{extra}"
        )
        for n in ns:
            for round_ in range(args.rounds):
                for route in rotated(routes, round_):
                    measure(route, n, args.seconds, expect)
            d, r = pooled(direct.rounds[n]), pooled(capyctl.rounds[n])
            d_rate = d["chunks"] / d["elapsed"]
            r_rate = r["chunks"] / r["elapsed"]
            added = statistics.median(r["ttfts"]) * 1000 - statistics.median(d["ttfts"]) * 1000
            if nginx is not None:
                x = pooled(routes[1].rounds[n])
                x_rate = x["chunks"] / x["elapsed"]
                extra = (
                    f" {pct(x['ttfts'], 0.5):>15.2f} {x_rate:>15.0f} {x_rate / d_rate:>6.2f} "
                    f"{x['cpu'] / x['chunks'] * 1000:>15.4f}"
                )
            print(
                f"{n:>4} {pct(d['ttfts'], 0.5):>12.2f} / {pct(r['ttfts'], 0.5):>9.2f} {added:>10.2f} "
                f"{pct(d['ttfts'], 0.99):>12.2f} / {pct(r['ttfts'], 0.99):>9.2f} "
                f"{d_rate:>16.0f} {r_rate:>10.0f} {r_rate / d_rate:>6.2f} {r['cpu'] / r['chunks'] * 1000:>16.3f}"
                f"{extra}"
            )
        if args.paced:
            for route in routes:
                route.paced = [[] for _ in range(args.rounds)]
            for i in range(args.paced):  # one stream per path in turn; the streams split evenly over the rounds
                round_ = i * args.rounds // args.paced
                for route in rotated(routes, i):
                    route.paced[round_].append(
                        asyncio.run(
                            paced_ttft(
                                route.host, route.port, route.body[:-1] + b',"replay_pace":"recorded"}', route.key
                            )
                        )
                    )
            direct_t = [t for r in direct.paced for t in r]
            relay_t = [t for r in capyctl.paced for t in r]
            print(
                "time to first token, engine at its recorded pace, one stream: "
                f"direct p50 {pct(direct_t, 0.5):.2f} ms, "
                f"relayed p50 {pct(relay_t, 0.5):.2f} ms, added {pct(relay_t, 0.5) - pct(direct_t, 0.5):.2f} ms "
                f"over {args.paced} streams each"
            )
            print(
                f"for scale, this machine's own hop: a one-byte round trip between two processes over loopback, "
                f"5 ms apart as paced streams are: p50 {loopback_round_trip():.0f} µs (any relay adds two hops, "
                f"one each way, to the first token)"
            )
            if nginx is not None:
                nginx_t = [t for r in routes[1].paced for t in r]
                print(
                    f"time to first token, engine at its recorded pace, one stream, through nginx: "
                    f"p50 {pct(nginx_t, 0.5):.2f} ms, added {pct(nginx_t, 0.5) - pct(direct_t, 0.5):.2f} ms; "
                    f"p99 direct {pct(direct_t, 0.99):.2f}, nginx {pct(nginx_t, 0.99):.2f}, "
                    f"relayed {pct(relay_t, 0.99):.2f} ms"
                )
        if args.hangups:
            paced = body[:-1] + b',"replay_pace":"recorded"}'
            stats_url = f"http://{rhost}:{rport}/replay/stats"
            for label, server in (("", capy), (", capyctl@base", base)):
                if server is None:
                    continue
                delays = [
                    asyncio.run(hang_up_delay("127.0.0.1", server.port, paced, server.api_key, stats_url))
                    for _ in range(args.hangups)
                ]
                print(
                    f"client hang-up -> engine connection closed{label}: p50 {pct(delays, 0.5):.2f} ms, "
                    f"p99 {pct(delays, 0.99):.2f} ms over {len(delays)} streams (includes one stats poll)"
                )
            if nginx is not None:
                paced_plain = plain[:-1] + b',"replay_pace":"recorded"}'
                delays = [
                    asyncio.run(hang_up_delay("127.0.0.1", nginx.port, paced_plain, None, stats_url))
                    for _ in range(args.hangups)
                ]
                print(
                    f"client hang-up -> engine connection closed, through nginx: p50 {pct(delays, 0.5):.2f} ms, "
                    f"p99 {pct(delays, 0.99):.2f} ms over {len(delays)} streams (includes one stats poll)"
                )
        if args.handoff:
            gaps = handoff(tmp, f"http://{rhost}:{rport}", engine, version, body, expect, args.handoff)
            print(
                f"slot freed -> next waiter sent to the engine (one slot, {args.handoff} waiting): "
                f"p50 {statistics.median(gaps):.2f} ms, p99 {pct_ms(gaps, 0.99):.2f} ms over {len(gaps)} hand-overs"
            )
        print()
        if args.paced:
            source = f"engine at its recorded pace, {args.paced} streams per path split over {args.rounds} rounds"
            summary(routes, ns, lambda route: route.paced, source)
        elif 1 in ns:
            summary(routes, ns, lambda route: [r["ttfts"] for r in route.rounds[1]], "the full-speed load at N=1")
        else:
            summary(routes, ns, lambda route: [], "not measured (--paced 0 and no N=1)")
    finally:
        if nginx is not None:
            nginx.stop()
        for floor in (bare, checked):
            if floor is not None:
                floor.kill()
                floor.wait(10)
        capy.stop()
        if base is not None:
            base.stop()
        replay.terminate()
        replay.wait(10)


def nginx_version(binary: str) -> str:
    try:
        out = subprocess.run([binary, "-v"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "version unknown"
    return (out.stderr or out.stdout).strip().removeprefix("nginx version: ") or "version unknown"


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
    config.write_text(
        f"queue:\n  max_in_flight_per_instance: 1\n  max_pending_per_deployment: {n}\n  max_pending_total: {n}\n"
    )
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
        return gaps[-(n - 1) :]  # the engine served only these since: its last n-1 idle gaps are theirs
    finally:
        one.stop()


if __name__ == "__main__":
    main()
