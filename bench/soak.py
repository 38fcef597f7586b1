"""Soak test: many requests through CapyCTL while clients hang up and the engine dies once.

    python bench/soak.py [--requests 10000] [--concurrency 64] [--kill-share 0.1] [--seed 1] [--json]

What it does. It starts a replay engine (the recorded vLLM 0.32.0 streams, case
chat_stream_usage: 203 data events) and a CapyCTL with the engine attached as the
deployment "soak". After a warm-up it sends --requests chat requests, half streamed and
half not, each on its own connection with its own X-Request-Id (soak-<n>), at most
--concurrency at a time. The engine sends one event every --interval-ms, so a request
takes about half a second. A --kill-share of the clients, chosen with --seed, hang up
after a random 0-200 ms. Once, when a third of the requests have started, the replay
engine is killed with SIGKILL and, --down seconds later, started again on the same port;
the "down window" runs from the kill until the new engine answers GET /health.

Every request ends as exactly one of:

  completed         a 200 stream whose last event is data: [DONE] with every recorded event,
                    or a 200 JSON answer with choices
  error answer      an error status with its OpenAI envelope (error.code), or a 200 stream
                    that ends with an error event (data: {"error": ...}); shown as "sse <code>"
  killed by client  we closed the connection before the answer was complete
  lost              not killed by us, yet no complete answer and no error answer: connection
                    refused or dropped, empty or cut answer, a stream without [DONE] or short
                    of events
  hung              no end of the answer within --timeout seconds (the bench then hangs up)

and, across requests, "duplicated" counts answers whose x-capyctl-request-id was seen on
another answer (or given twice), whose x-request-id is not the one sent, or whose stream
holds two [DONE].

Server errors (5xx statuses and in-stream error events) are split by code into those of
requests in flight at some moment of the down window (expected: the engine was gone)
and those outside it (a defect). CapyCTL's open file descriptors (/proc/PID/fd) and
resident memory (VmRSS) are printed at the start (after the warm-up), at their peak
(sampled every 100 ms) and at the end (after a settle wait: until the count stops falling,
at most --settle s), with CapyCTL's sockets split into client connections, engine
connections (by TCP state) and the rest. Engine connections are not zero when idle:
CapyCTL keeps up to 64 idle relay connections per engine, and its health checks keep
their own keep-alive connections (they show as CLOSE_WAIT once the engine's 30 s
keep-alive timeout has closed its side). "end - start" should therefore be about zero
or negative; client connections left at the end, or engine connections growing run
after run, are leaks.

Problems come with examples (request number, both request IDs, times) and the lines of
CapyCTL's log that name the example (read after CapyCTL has stopped: it writes its log
buffered), plus the first traceback of the log.

Exit status 0 when nothing was lost, duplicated or hung, no server error came outside the
down window, no 4xx came (every request sent is valid), CapyCTL is still running and the
engine came back; 1 otherwise. --json prints the same summary as one JSON object.
All traffic is on 127.0.0.1; both processes are stopped on the way out, Ctrl-C included.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.integration.harness import CapyServer  # noqa: E402

RECORDING = ROOT / "tests/contract/recordings/vllm/0.32.0"
HOST = "127.0.0.1"
_LISTENING = re.compile(r"listening on http://([\d.]+):(\d+)")
_decode = msgspec.json.decode


# -- processes ---------------------------------------------------------------------------------------------


def raise_fd_limit() -> tuple[int, int]:
    """Soft RLIMIT_NOFILE up to the hard limit (children inherit it); returns (soft, hard)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


class Replay:
    """The replay engine as a child process on 127.0.0.1; its output goes to a log file. Restartable on
    the same port."""

    def __init__(self, recording: Path, log_dir: Path) -> None:
        self.recording = recording
        self.log_dir = log_dir
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def launch(self) -> Path:
        """Start the process (on self.port, 0 for a free one) without waiting; returns its log file."""
        self.starts += 1
        log_path = self.log_dir / f"replay-{self.starts}.log"
        with open(log_path, "wb") as log:
            self.process = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "capyctl.replay",
                    "--dialect",
                    self.recording.parent.name,
                    "--version",
                    self.recording.name,
                    "--recordings",
                    str(self.recording),
                    "--host",
                    HOST,
                    "--port",
                    str(self.port),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        return log_path

    def start(self, timeout: float = 30.0) -> None:
        """Start and wait for its "listening on" line; learns the port."""
        log_path = self.launch()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = _LISTENING.search(log_path.read_text(errors="replace"))
            if match:
                self.port = int(match.group(2))
                return
            if self.process.poll() is not None:  # type: ignore[union-attr]
                break
            time.sleep(0.02)
        raise RuntimeError(f"the replay engine did not start:\n{log_path.read_text(errors='replace')}")

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def log(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.log_dir.glob("replay-*.log")))


class Stack:
    """A replay engine and a CapyCTL with it attached as deployment NAME; both stopped by ``close``."""

    def __init__(self, recording: Path, name: str, *capy_args: str) -> None:
        self.tmp = Path(tempfile.mkdtemp(prefix=f"capyctl-{name}-"))
        self.name = name
        self.replay = Replay(recording, self.tmp)
        self.capy = CapyServer(self.tmp / "state", *capy_args)

    def open(self) -> Stack:
        self.replay.start()
        self.capy.start()
        doc = {
            "name": self.name,
            "engine": self.replay.recording.parent.name,
            "endpoint": self.replay.url,
            "engine_version": self.replay.recording.name,
        }
        path = self.tmp / f"{self.name}.yaml"
        path.write_bytes(msgspec.yaml.encode(doc))
        self.capy.cli("deploy", "model", "--file", str(path))
        return self

    @property
    def pid(self) -> int:
        return self.capy.process.pid  # type: ignore[union-attr]

    def capy_alive(self) -> bool:
        return self.capy.process is not None and self.capy.process.poll() is None

    def close(self) -> int | None:
        """Stop CapyCTL (SIGTERM), then the engine; returns CapyCTL's exit status (None if never started)."""
        status: int | None = None
        try:
            if self.capy.process is not None:
                try:
                    status = self.capy.stop()
                except AssertionError as exc:  # did not stop in time: it was killed
                    print(f"warning: {str(exc).splitlines()[0]}", file=sys.stderr)
                    status = self.capy.process.returncode
        finally:
            self.replay.stop()
        return status


# -- /proc -----------------------------------------------------------------------------------------------


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_TCP_STATES = {
    "01": "ESTABLISHED",
    "02": "SYN_SENT",
    "03": "SYN_RECV",
    "04": "FIN_WAIT1",
    "05": "FIN_WAIT2",
    "06": "TIME_WAIT",
    "07": "CLOSE",
    "08": "CLOSE_WAIT",
    "09": "LAST_ACK",
    "0A": "LISTEN",
    "0B": "CLOSING",
}


def fd_breakdown(pid: int, listen_port: int, engine_port: int) -> dict[str, Any]:
    """CapyCTL's fds: client connections, engine connections (by TCP state), listening sockets, the rest."""
    tcp: dict[str, tuple[int, int, str]] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            tcp[f[9]] = (int(f[1].rsplit(":", 1)[1], 16), int(f[2].rsplit(":", 1)[1], 16), _TCP_STATES.get(f[3], f[3]))
    out: dict[str, Any] = {"total": 0, "clients": 0, "engine": 0, "engine_states": {}, "listening": 0, "other": 0}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        out["total"] += 1
        inode = target[len("socket:[") : -1] if target.startswith("socket:[") else None
        local, remote, state = tcp.get(inode, (0, 0, "")) if inode else (0, 0, "")
        if state == "LISTEN":
            out["listening"] += 1
        elif remote == engine_port and engine_port:
            out["engine"] += 1
            out["engine_states"][state] = out["engine_states"].get(state, 0) + 1
        elif local == listen_port and state:
            out["clients"] += 1
        else:
            out["other"] += 1
    return out


def describe_fds(b: dict[str, Any]) -> str:
    states = ", ".join(f"{k} {v}" for k, v in sorted(b["engine_states"].items()))
    return (
        f"{b['total']} fds: {b['clients']} client connections, {b['engine']} engine connections"
        f"{f' ({states})' if states else ''}, {b['listening']} listening, {b['other']} other"
    )


class Sampler:
    """Samples a process's fd count and RSS every ``every`` seconds in a background task; keeps the peaks."""

    def __init__(self, pid: int, every: float = 0.1) -> None:
        self.pid, self.every = pid, every
        self.peak_fds = self.peak_rss_kb = 0
        self.samples = 0
        self._task: asyncio.Task[None] | None = None

    def take(self) -> tuple[int, int]:
        fds, rss = fd_count(self.pid), rss_kb(self.pid)
        self.peak_fds, self.peak_rss_kb = max(self.peak_fds, fds), max(self.peak_rss_kb, rss)
        self.samples += 1
        return fds, rss

    async def _run(self) -> None:
        while True:
            try:
                self.take()
            except OSError:  # the process is gone; the caller notices
                return
            await asyncio.sleep(self.every)

    def __enter__(self) -> Sampler:
        self._task = asyncio.get_running_loop().create_task(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()


async def settle(pid: int, bound: float, quiet: float = 2.0) -> float:
    """Wait until the fd count has not fallen for ``quiet`` s (at most ``bound`` s); returns the seconds waited."""
    began = time.monotonic()
    lowest = fd_count(pid)
    since = began
    while time.monotonic() - began < bound and time.monotonic() - since < quiet:
        await asyncio.sleep(0.25)
        now = fd_count(pid)
        if now < lowest:
            lowest, since = now, time.monotonic()
    return time.monotonic() - began


async def http_get(port: int, path: str, timeout: float = 2.0) -> tuple[int, bytes]:
    """(status, body) of a GET on 127.0.0.1; (0, b"") when nothing answers."""
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(HOST, port)
            writer.write(f"GET {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nConnection: close\r\n\r\n".encode())
            data = await reader.read(-1)
            writer.close()
    except (OSError, TimeoutError):
        return 0, b""
    status, _, body, _ = parse_answer(data)
    return status, body


# -- the client ------------------------------------------------------------------------------------------


def chat_request(port: int, key: str, body: bytes, request_id: str | None) -> bytes:
    rid = f"X-Request-Id: {request_id}\r\n" if request_id else ""
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {HOST}:{port}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\n{rid}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


def chat_body(model: str, case: str, stream: bool, interval_ms: float) -> bytes:
    return msgspec.json.encode(
        {
            "model": model,
            "stream": stream,
            "replay_case": case,
            "replay_interval_ms": interval_ms,
            "messages": [{"role": "user", "content": "hi"}],
        }
    )


class _Conn(asyncio.Protocol):
    """One request on its own connection: writes it, keeps every byte of the answer, resolves at close."""

    __slots__ = ("payload", "parts", "done", "transport", "error")

    def __init__(self, payload: bytes, done: asyncio.Future[None]) -> None:
        self.payload, self.done = payload, done
        self.parts: list[bytes] = []
        self.transport: asyncio.Transport | None = None
        self.error: BaseException | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        transport.write(self.payload)  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        self.parts.append(data)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.error = exc
        if not self.done.done():
            self.done.set_result(None)


def parse_answer(data: bytes) -> tuple[int, dict[bytes, list[bytes]], bytes, str]:
    """(status, headers, body, problem) of a raw HTTP/1.1 answer read to EOF; problem "" when whole."""
    head, sep, rest = data.partition(b"\r\n\r\n")
    if not sep:
        return 0, {}, b"", "empty answer" if not data else f"cut in the headers after {len(data)} bytes"
    lines = head.split(b"\r\n")
    try:
        status = int(lines[0].split(b" ", 2)[1])
    except (IndexError, ValueError):
        return 0, {}, b"", f"bad status line {lines[0][:80]!r}"
    headers: dict[bytes, list[bytes]] = {}
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        headers.setdefault(name.strip().lower(), []).append(value.strip())
    if headers.get(b"transfer-encoding", [b""])[-1].lower() == b"chunked":
        parts: list[bytes] = []
        pos = 0
        while True:
            eol = rest.find(b"\r\n", pos)
            if eol < 0:
                return status, headers, b"".join(parts), "cut in the chunked body"
            try:
                size = int(rest[pos:eol].split(b";", 1)[0], 16)
            except ValueError:
                return status, headers, b"".join(parts), "bad chunk size"
            if size == 0:
                return status, headers, b"".join(parts), ""
            start = eol + 2
            parts.append(rest[start : start + size])
            if start + size + 2 > len(rest):
                return status, headers, b"".join(parts), "cut in the chunked body"
            pos = start + size + 2
    length = headers.get(b"content-length")
    if length is not None:
        want = int(length[-1])
        if len(rest) < want:
            return status, headers, rest, f"cut after {len(rest)} of {want} body bytes"
        return status, headers, rest[:want], ""
    return status, headers, rest, ""  # framed by the close


def error_code(body: bytes) -> str:
    try:
        obj = _decode(body)
        code = obj["error"]["code"]
    except (msgspec.DecodeError, KeyError, TypeError):
        return "(no error envelope)"
    return str(code)


class Record:
    """What happened to one request (times are seconds since the start of the run)."""

    __slots__ = (
        "n",
        "stream",
        "kill_after",
        "start",
        "end",
        "outcome",
        "detail",
        "status",
        "code",
        "capy_ids",
        "echoed",
        "events",
        "dup",
    )

    def __init__(self, n: int, stream: bool, kill_after: float | None) -> None:
        self.n, self.stream, self.kill_after = n, stream, kill_after
        self.start = self.end = 0.0
        self.outcome = self.detail = self.code = self.dup = ""
        self.status = self.events = 0
        self.capy_ids: list[str] = []
        self.echoed: list[str] = []

    @property
    def request_id(self) -> str:
        return f"soak-{self.n}"

    def as_dict(self) -> dict[str, Any]:
        return {
            "n": self.n,
            "x_request_id_sent": self.request_id,
            "stream": self.stream,
            "outcome": self.outcome,
            "status": self.status,
            "code": self.code,
            "detail": self.detail,
            "duplicated": self.dup,
            "x_capyctl_request_id": self.capy_ids,
            "x_request_id_back": self.echoed,
            "start_s": round(self.start, 3),
            "end_s": round(self.end, 3),
            "kill_after_ms": None if self.kill_after is None else round(self.kill_after * 1000, 1),
        }


def note_headers(rec: Record, partial: bytes) -> None:
    """The IDs of an answer we stopped reading (killed or hung), if its headers had come."""
    head, sep, _ = partial.partition(b"\r\n\r\n")
    if sep:
        rec.status = int(head.split(b" ", 2)[1]) if head[:5] == b"HTTP/" else 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"x-capyctl-request-id":
                rec.capy_ids.append(value.strip().decode("latin-1"))
            elif name == b"x-request-id":
                rec.echoed.append(value.strip().decode("latin-1"))
        if len(rec.capy_ids) > 1:
            rec.dup = f"x-capyctl-request-id given {len(rec.capy_ids)} times"
        elif rec.echoed and rec.echoed != [rec.request_id]:
            rec.dup = f"x-request-id {rec.echoed} handed back for {rec.request_id}"


def classify(rec: Record, data: bytes, expect_events: int) -> None:
    status, headers, body, problem = parse_answer(data)
    rec.status = status
    rec.capy_ids = [v.decode("latin-1") for v in headers.get(b"x-capyctl-request-id", [])]
    rec.echoed = [v.decode("latin-1") for v in headers.get(b"x-request-id", [])]
    if len(rec.capy_ids) > 1:
        rec.dup = f"x-capyctl-request-id given {len(rec.capy_ids)} times"
    elif rec.echoed and rec.echoed != [rec.request_id]:
        rec.dup = f"x-request-id {rec.echoed} handed back for {rec.request_id}"
    if status == 0:
        rec.outcome, rec.detail = "lost", problem
        return
    if status >= 400:
        rec.outcome, rec.code = "error", error_code(body)
        rec.detail = problem
        return
    if problem:
        rec.outcome, rec.detail = "lost", f"{status} answer {problem}"
        return
    if status != 200:
        rec.outcome, rec.detail = "lost", f"unexpected status {status}"
        return
    if not rec.stream:
        try:
            choices = _decode(body).get("choices")
        except (msgspec.DecodeError, AttributeError):
            choices = None
        if choices:
            rec.outcome = "completed"
        else:
            rec.outcome, rec.detail = "lost", f"200 JSON without choices: {body[:120]!r}"
        return
    data_events = [e for e in body.split(b"\n\n") if e.startswith(b"data: ")]
    rec.events = len(data_events)
    dones = sum(1 for e in data_events if e == b"data: [DONE]")
    if dones > 1:
        rec.dup = rec.dup or f"{dones} data: [DONE] in one stream"
    last = data_events[-1] if data_events else b""
    if last.startswith(b'data: {"error"'):
        rec.outcome, rec.code = "error", error_code(last[len(b"data: ") :])
        rec.status = 0  # an error event in a 200 stream: reported as "sse <code>"
    elif last == b"data: [DONE]" and len(data_events) == expect_events:
        rec.outcome = "completed"
    elif last == b"data: [DONE]":
        rec.outcome, rec.detail = "lost", f"stream of {len(data_events)} data events, {expect_events} expected"
    else:
        rec.outcome, rec.detail = "lost", f"stream of {len(data_events)} data events ended without [DONE]"


async def one_request(rec: Record, port: int, payload: bytes, timeout: float, t0: float, expect: int) -> None:
    loop = asyncio.get_running_loop()
    began = time.monotonic()
    rec.start = began - t0
    done: asyncio.Future[None] = loop.create_future()
    conn = _Conn(payload, done)
    try:
        async with asyncio.timeout(timeout):
            await loop.create_connection(lambda: conn, HOST, port)
    except TimeoutError:
        rec.outcome, rec.detail, rec.end = "hung", "connect did not finish", time.monotonic() - t0
        return
    except OSError as exc:
        rec.outcome, rec.detail, rec.end = "lost", f"connect failed: {exc}", time.monotonic() - t0
        return
    if rec.kill_after is not None:
        left = began + rec.kill_after - time.monotonic()
        if left > 0 and not done.done():
            await asyncio.wait((done,), timeout=left)
        if not done.done():
            conn.transport.abort()  # type: ignore[union-attr]
            got = sum(map(len, conn.parts))
            rec.outcome, rec.end = "killed", time.monotonic() - t0
            rec.detail = "before any answer byte" if not got else f"after {got} answer bytes"
            note_headers(rec, b"".join(conn.parts))
            return
    left = began + timeout - time.monotonic()
    if left > 0 and not done.done():
        await asyncio.wait((done,), timeout=left)
    rec.end = time.monotonic() - t0
    if not done.done():
        conn.transport.abort()  # type: ignore[union-attr]
        rec.outcome = "hung"
        rec.detail = f"no end of the answer in {timeout:g} s ({sum(map(len, conn.parts))} bytes came)"
        note_headers(rec, b"".join(conn.parts))
        return
    classify(rec, b"".join(conn.parts), expect)
    if rec.outcome == "lost" and conn.error is not None:
        rec.detail += f" ({conn.error!r})"


# -- the run ---------------------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


async def soak(stack: Stack, args: argparse.Namespace) -> dict[str, Any]:
    capy, replay = stack.capy, stack.replay
    pid, port, key = stack.pid, capy.port, capy.api_key
    expect = (replay.recording / f"{args.case}.sse").read_bytes().count(b"data: ")
    bodies = {s: chat_body(stack.name, args.case, s, args.interval_ms) for s in (True, False)}

    # warm-up: fill CapyCTL's pool of engine connections and its caches, uncounted
    for _ in range(2):
        warm = [Record(-1, True, None) for _ in range(args.concurrency)]
        await asyncio.gather(
            *(one_request(r, port, chat_request(port, key, bodies[True], None), 30, 0, expect) for r in warm)
        )
        bad = [r for r in warm if r.outcome != "completed"]
        if bad:
            raise RuntimeError(
                f"warm-up failed: {bad[0].outcome} {bad[0].status} {bad[0].code} {bad[0].detail}\n{capy.log()[-3000:]}"
            )
    await asyncio.sleep(0.5)
    start_fds, start_rss = fd_count(pid), rss_kb(pid)
    start_break = fd_breakdown(pid, port, replay.port)
    cpu_before = cpu_seconds(pid)

    rng = random.Random(args.seed)
    plan: list[Record] = []
    for n in range(args.requests):
        kill = rng.random() < args.kill_share
        delay = rng.uniform(0.0, 0.2)
        plan.append(Record(n, n % 2 == 0, delay if kill else None))
    kill_at_n = int(args.requests * args.engine_kill_at) if args.engine_kill_at > 0 else -1
    third = asyncio.Event()
    window: dict[str, Any] = {"kill_at": None, "back_at": None, "error": None}
    t0 = time.monotonic()

    async def chaos() -> None:
        await third.wait()
        window["kill_at"] = time.monotonic() - t0
        replay.kill()
        await asyncio.sleep(args.down)
        replay.launch()  # the same port
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if replay.process.poll() is not None:  # type: ignore[union-attr]
                window["error"] = f"the restarted engine exited {replay.process.returncode}: {replay.log()[-500:]}"
                return
            if (await http_get(replay.port, "/health", 0.5))[0] == 200:
                window["back_at"] = time.monotonic() - t0
                return
            await asyncio.sleep(0.02)
        window["error"] = "the restarted engine did not answer /health within 30 s"

    queue = iter(plan)

    async def worker() -> None:
        for rec in queue:
            if rec.n == kill_at_n:
                third.set()
            await one_request(
                rec, port, chat_request(port, key, bodies[rec.stream], rec.request_id), args.timeout, t0, expect
            )

    with Sampler(pid) as sampler:
        sampler.take()
        chaos_task = asyncio.get_running_loop().create_task(chaos())
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        elapsed = time.monotonic() - t0
        if kill_at_n >= 0:
            await chaos_task
        else:
            chaos_task.cancel()
        alive = stack.capy_alive()
        settled = await settle(pid, args.settle) if alive else 0.0
        if alive:
            sampler.take()
    cpu = cpu_seconds(pid) - cpu_before if alive else None
    end_fds, end_rss = (fd_count(pid), rss_kb(pid)) if alive else (None, None)
    end_break = fd_breakdown(pid, port, replay.port) if alive else None
    engine_stats = None
    if window["back_at"] is not None or kill_at_n < 0:
        status, body = await http_get(replay.port, "/replay/stats")
        if status == 200:
            engine_stats = {k: v for k, v in _decode(body).items() if k != "last_request"}
    return summarize(
        plan,
        args,
        stack,
        window,
        elapsed,
        alive,
        cpu,
        engine_stats,
        {
            "start": {"fds": start_fds, "rss_mb": round(start_rss / 1024, 1), "breakdown": start_break},
            "peak": {
                "fds": sampler.peak_fds,
                "rss_mb": round(sampler.peak_rss_kb / 1024, 1),
                "samples": sampler.samples,
            },
            "end": {
                "fds": end_fds,
                "rss_mb": None if end_rss is None else round(end_rss / 1024, 1),
                "breakdown": end_break,
                "settle_s": round(settled, 1),
            },
        },
    )


def summarize(
    plan: list[Record],
    args: argparse.Namespace,
    stack: Stack,
    window: dict[str, Any],
    elapsed: float,
    alive: bool,
    cpu: float | None,
    engine_stats: dict | None,
    proc: dict[str, Any],
) -> dict[str, Any]:
    kill_at, back_at = window["kill_at"], window["back_at"]

    def in_window(r: Record) -> bool:
        if kill_at is None:
            return False
        return r.start <= (back_at if back_at is not None else float("inf")) and r.end >= kill_at

    seen = Counter(i for r in plan for i in r.capy_ids)
    for r in plan:
        again = [i for i in r.capy_ids if seen[i] > 1]
        if again and not r.dup:
            r.dup = f"x-capyctl-request-id {again[0]} also on another answer"
    outcomes = Counter(r.outcome for r in plan)
    duplicated = [r for r in plan if r.dup]
    server_in: Counter[str] = Counter()
    server_out: Counter[str] = Counter()
    client_errors: Counter[str] = Counter()
    outside: list[Record] = []
    for r in plan:
        if r.outcome != "error":
            continue
        label = f"{r.status} {r.code}" if r.status else f"sse {r.code}"
        if 400 <= r.status < 500:
            client_errors[label] += 1
        elif in_window(r):
            server_in[label] += 1
        else:
            server_out[label] += 1
            outside.append(r)
    completed = [r for r in plan if r.outcome == "completed"]
    killed = [r for r in plan if r.outcome == "killed"]
    lost = [r for r in plan if r.outcome == "lost"]
    hung = [r for r in plan if r.outcome == "hung"]
    missing_id = [r for r in plan if r.outcome not in ("killed", "hung") and r.status and not r.capy_ids]
    lat = {kind: [r.end - r.start for r in completed if r.stream is kind] for kind in (True, False)}
    ok = (
        not lost
        and not duplicated
        and not hung
        and not server_out
        and not client_errors
        and alive
        and (args.engine_kill_at <= 0 or back_at is not None)
    )
    problems = {
        "lost": lost,
        "duplicated": duplicated,
        "hung": hung,
        "server_error_outside_window": outside,
        "client_error": [r for r in plan if r.outcome == "error" and 400 <= r.status < 500],
    }
    examples = {}
    for name, recs in problems.items():
        if recs:
            examples[name] = [r.as_dict() for r in recs[: args.examples]]
    return {
        "config": {
            "requests": args.requests,
            "concurrency": args.concurrency,
            "kill_share": args.kill_share,
            "seed": args.seed,
            "interval_ms": args.interval_ms,
            "case": args.case,
            "recording": str(
                stack.replay.recording.relative_to(ROOT)
                if stack.replay.recording.is_relative_to(ROOT)
                else stack.replay.recording
            ),
            "timeout_s": args.timeout,
            "cores": os.cpu_count(),
        },
        "elapsed_s": round(elapsed, 1),
        "requests_per_s": round(len(plan) / elapsed, 1),
        "engine_down": {
            "killed_at_s": kill_at and round(kill_at, 2),
            "back_at_s": back_at and round(back_at, 2),
            "down_s": round(back_at - kill_at, 2) if kill_at is not None and back_at is not None else None,
            "error": window["error"],
            "in_flight_in_window": sum(map(in_window, plan)),
        },
        "sent": len(plan),
        "completed": len(completed),
        "completed_streamed": sum(r.stream for r in completed),
        "completed_whole": sum(not r.stream for r in completed),
        "killed_by_client": len(killed),
        "killed_before_any_answer_byte": sum(r.detail == "before any answer byte" for r in killed),
        "error_answers": outcomes["error"],
        "lost": len(lost),
        "duplicated": len(duplicated),
        "hung": len(hung),
        "missing_x_capyctl_request_id": len(missing_id),
        "server_errors_in_down_window": dict(server_in.most_common()),
        "server_errors_outside_down_window": dict(server_out.most_common()),
        "client_errors": dict(client_errors.most_common()),
        "latency_ms": {
            ("streamed" if kind else "whole"): {
                "p50": round(percentile(v, 0.5) * 1000, 1),
                "p99": round(percentile(v, 0.99) * 1000, 1),
                "max": round(max(v) * 1000, 1) if v else 0.0,
            }
            for kind, v in lat.items()
        },
        "capyctl": {"pid": stack.pid, "alive": alive, "cpu_s": cpu and round(cpu, 1), **proc},
        "engine_stats_after_restart": engine_stats,
        "examples": examples,
        "ok": ok,
    }


def add_log(summary: dict[str, Any], log: str) -> None:
    """CapyCTL's log, read once it has stopped (it writes its log buffered): tracebacks, and the lines
    naming each example request (by its x-capyctl-request-id or the caller's ID)."""
    lines = log.splitlines()
    summary["log"] = {
        "lines": len(lines),
        "tracebacks": log.count("Traceback"),
        "error_lines": sum(1 for line in lines if " ERROR " in line or '"level":"error"' in line.lower()),
        "first_traceback": first_traceback(log),
    }
    for recs in summary["examples"].values():
        for r in recs:
            caller = f"(caller {r['x_request_id_sent']})"
            keys = set(r["x_capyctl_request_id"])
            for line in lines:  # the line that names the caller's ID names CapyCTL's too: "request <id> (caller ..."
                if caller in line:
                    keys.add(line.partition("request ")[2].split(" ", 1)[0] or caller)
            keys.add(caller)
            r["log"] = [line for line in lines if any(k in line for k in keys)][:8]


def first_traceback(log: str, lines: int = 40) -> str:
    at = log.find("Traceback")
    if at < 0:
        return ""
    start = log.rfind("\n", 0, at - 1)
    start = log.rfind("\n", 0, start) + 1 if start > 0 else 0  # the line that logged it, too
    return "\n".join(log[start:].splitlines()[:lines])


def print_summary(s: dict[str, Any]) -> None:
    c = s["config"]
    print(
        f"soak: {c['requests']} requests (half streamed), concurrency {c['concurrency']}, kill share "
        f"{c['kill_share']}, seed {c['seed']}; {c['recording']} case {c['case']} at {c['interval_ms']} ms "
        f"per event; {c['cores']} cores"
    )
    print(f"ran {s['elapsed_s']} s, {s['requests_per_s']} requests/s")
    d = s["engine_down"]
    if d["killed_at_s"] is not None:
        back = (
            f"back at {d['back_at_s']} s: down {d['down_s']} s"
            if d["back_at_s"] is not None
            else f"NOT BACK: {d['error']}"
        )
        print(
            f"engine SIGKILLed at {d['killed_at_s']} s, {back}; {d['in_flight_in_window']} requests in flight "
            f"in that window"
        )
    rows = [
        ("sent", s["sent"], ""),
        ("completed", s["completed"], f"streamed {s['completed_streamed']}, whole {s['completed_whole']}"),
        ("killed by client", s["killed_by_client"], f"{s['killed_before_any_answer_byte']} before any answer byte"),
        ("error answers", s["error_answers"], ""),
        ("lost", s["lost"], ""),
        ("duplicated", s["duplicated"], ""),
        ("hung", s["hung"], ""),
        ("no x-capyctl-request-id", s["missing_x_capyctl_request_id"], ""),
    ]
    for label, value, note in rows:
        print(f"  {label:<24}{value:>7}{'   ' + note if note else ''}")
    codes = sorted(set(s["server_errors_in_down_window"]) | set(s["server_errors_outside_down_window"]))
    print("  server errors (5xx, sse = error event in a 200 stream)   in down window   outside")
    if not codes:
        print(f"    {'(none)':<54}{0:>14}{0:>10}")
    for code in codes:
        print(
            f"    {code:<54}{s['server_errors_in_down_window'].get(code, 0):>14}"
            f"{s['server_errors_outside_down_window'].get(code, 0):>10}"
        )
    if s["client_errors"]:
        print(f"  4xx: {s['client_errors']}")
    lat = s["latency_ms"]
    print(
        f"  completed latency ms: streamed p50 {lat['streamed']['p50']} p99 {lat['streamed']['p99']} max "
        f"{lat['streamed']['max']}; whole p50 {lat['whole']['p50']} p99 {lat['whole']['p99']} max "
        f"{lat['whole']['max']}"
    )
    p = s["capyctl"]
    print(
        f"CapyCTL pid {p['pid']} {'running' if p['alive'] else 'NOT RUNNING (crashed)'}, "
        f"CPU {p['cpu_s']} s during the run"
    )
    print(f"  fds     start {p['start']['fds']:>6}   peak {p['peak']['fds']:>6}   end {p['end']['fds']}")
    print(
        f"  RSS MB  start {p['start']['rss_mb']:>6}   peak {p['peak']['rss_mb']:>6}   end {p['end']['rss_mb']}"
        f"   ({p['peak']['samples']} samples, settle {p['end']['settle_s']} s)"
    )
    print(f"  start: {describe_fds(p['start']['breakdown'])}")
    if p["end"]["breakdown"]:
        a, b = p["start"]["breakdown"], p["end"]["breakdown"]
        print(f"  end:   {describe_fds(b)}")
        print(
            f"  end - start: {b['total'] - a['total']:+d} fds ({b['clients'] - a['clients']:+d} client, "
            f"{b['engine'] - a['engine']:+d} engine, {b['other'] - a['other']:+d} other)"
        )
    if s["engine_stats_after_restart"]:
        print(
            f"{'restarted ' if d['killed_at_s'] is not None else ''}engine's /replay/stats at the end: "
            f"{s['engine_stats_after_restart']}"
        )
    lg = s["log"]
    print(f"CapyCTL log: {lg['lines']} lines, {lg['tracebacks']} tracebacks, {lg['error_lines']} ERROR lines")
    if lg["first_traceback"]:
        print("  first traceback:")
        for line in lg["first_traceback"].splitlines():
            print(f"    | {line}")
    for name, recs in s["examples"].items():
        print(f"examples, {name}:")
        for r in recs:
            print(
                f"  #{r['n']} {'stream' if r['stream'] else 'whole'} sent {r['x_request_id_sent']} got "
                f"x-capyctl-request-id {r['x_capyctl_request_id']} x-request-id {r['x_request_id_back']}: "
                f"{r['outcome']} {r['status'] or ''} {r['code']} {r['detail']} {r['duplicated']} "
                f"[{r['start_s']} s .. {r['end_s']} s]"
            )
            for line in r["log"]:
                print(f"    | {line}")
    print(
        "verdict: " + ("OK" if s["ok"] else "FAIL") + f" (lost {s['lost']}, duplicated {s['duplicated']}, "
        f"hung {s['hung']}, server errors outside the down window "
        f"{sum(s['server_errors_outside_down_window'].values())}, 4xx {sum(s['client_errors'].values())})"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=10000, help="requests to send (default 10000)")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight at most (default 64)")
    parser.add_argument(
        "--kill-share",
        type=float,
        default=0.1,
        help="share of clients that hang up after a random 0-200 ms (default 0.1)",
    )
    parser.add_argument("--seed", type=int, default=1, help="seed for which clients hang up, and when (default 1)")
    parser.add_argument(
        "--interval-ms",
        type=float,
        default=2.0,
        help="the engine's wait before the first event and between events (default 2: about 0.4 s a request)",
    )
    parser.add_argument(
        "--engine-kill-at",
        type=float,
        default=1 / 3,
        help="SIGKILL the engine when this share of the requests has started (default 1/3; 0: never)",
    )
    parser.add_argument(
        "--down", type=float, default=1.5, help="seconds between the engine's kill and its restart (default 1.5)"
    )
    parser.add_argument(
        "--timeout", type=float, default=60.0, help="seconds a request may take before it counts as hung (default 60)"
    )
    parser.add_argument(
        "--settle",
        type=float,
        default=10.0,
        help="at most this many seconds to wait for CapyCTL's fds to stop falling (default 10)",
    )
    parser.add_argument("--recording", type=Path, default=RECORDING, help="recording folder (default vllm/0.32.0)")
    parser.add_argument("--case", default="chat_stream_usage", help="case every request asks for")
    parser.add_argument("--examples", type=int, default=3, help="example requests shown per problem (default 3)")
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    args = parser.parse_args()
    if args.requests < 1 or args.concurrency < 1 or not 0 <= args.kill_share <= 1:
        parser.error("--requests and --concurrency must be >= 1, --kill-share within 0..1")
    raise_fd_limit()
    # Room in line for every client twice over: a client killed while it waits is dropped from the line
    # only once CapyCTL has read its hang-up, and the soak's client is already sending its next request.
    # The default slots (32 in flight) stay, so half the clients wait in line.
    config = (
        f"queue:\n  max_pending_per_deployment: {2 * args.concurrency}\n  max_pending_total: {2 * args.concurrency}\n"
    )
    return run_bench(
        "soak",
        args,
        soak,
        print_summary,
        config=config,
        after=lambda summary, stack: add_log(summary, stack.capy.log()),
    )


def run_bench(
    name: str,
    args: argparse.Namespace,
    body: Callable[[Stack, argparse.Namespace], Any],
    show: Callable[[dict[str, Any]], None],
    after: Callable[[dict[str, Any], Stack], None] = lambda summary, stack: None,
    config: str | None = None,
) -> int:
    """Start the stack (CapyCTL with ``config`` as its configuration file), run ``body`` on it,
    always stop it, print the summary; 0 when it says ok."""
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM cleans up like Ctrl-C
    capy_args: tuple[str, ...] = ()
    if config is not None:
        path = Path(tempfile.mkdtemp(prefix=f"capyctl-{name}-config-")) / "config.yaml"
        path.write_text(config)
        capy_args = ("--config", str(path))
    stack = Stack(args.recording.resolve(), name, *capy_args)
    try:
        stack.open()
        summary = run_loop(body(stack, args))
    finally:
        status = stack.close()
    summary["capyctl"]["exit_status_on_sigterm"] = status
    after(summary, stack)
    if args.json:
        print(json.dumps(summary))
    else:
        show(summary)
        print(f"CapyCTL exited {status} on SIGTERM; its log: {stack.capy.log_path}")
    return 0 if summary["ok"] else 1


def entry(main: Callable[[], int]) -> None:
    """``sys.exit(main())``, with Ctrl-C reported once the stack is stopped."""
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the finally in run_bench has stopped CapyCTL and the replay engine
        print("interrupted; CapyCTL and the replay engine are stopped", file=sys.stderr)
        sys.exit(130)


def run_loop(coro: Any) -> Any:
    """Run on uvloop when it is installed (a cheaper client), else asyncio."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


if __name__ == "__main__":
    entry(main)
