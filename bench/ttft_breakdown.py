"""Where a relayed stream's first token spends its time: timestamps along CapyCTL's path, one request at a time.

    python bench/ttft_breakdown.py [--requests 200] [--paced] [--recording tests/contract/recordings/vllm/0.32.0]

It starts the replay engine and a CapyCTL whose hot path is wrapped with
timestamps (``time.perf_counter_ns``, the same clock in every process on
Linux), sends sequential streamed requests with a raw-socket client that
stamps its own connect, send and first ``data:`` byte, and prints the median
time of each step from the client's connect to its first token, in path
order, beside the same request sent straight to the engine. ``--paced``
makes the engine wait as it did when recorded before its first chunk (the
case where CapyCTL's caches and CPUs have gone cold meanwhile).

The wrappers cost about 0.5 µs each and there are some forty per request:
read the steps, not the total. Nothing here changes CapyCTL's behaviour;
the stamps exist only in the process this script starts.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
STAMPS: list[tuple[str, int]] = []


def mark(label: str) -> None:
    STAMPS.append((label, time.perf_counter_ns()))


def wrap_sync(owner: Any, name: str, label: str) -> None:
    original = getattr(owner, name)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        mark(label + " >")
        try:
            return original(*args, **kwargs)
        finally:
            mark(label + " <")

    setattr(owner, name, wrapped)


def wrap_async(owner: Any, name: str, label: str) -> None:
    original = getattr(owner, name)

    async def wrapped(*args: Any, **kwargs: Any) -> Any:
        mark(label + " >")
        try:
            return await original(*args, **kwargs)
        finally:
            mark(label + " <")

    setattr(owner, name, wrapped)


def wrap_context(owner: Any, name: str, label: str) -> None:
    original = getattr(owner, name)

    @asynccontextmanager
    async def wrapped(*args: Any, **kwargs: Any) -> Any:
        mark(label + " >")
        async with original(*args, **kwargs) as value:
            mark(label + " <")
            yield value

    setattr(owner, name, wrapped)


def serve(argv: list[str]) -> None:
    """CapyCTL with stamps along its hot path; SIGUSR1 writes them to $STAMP_OUT and exits."""
    import msgspec
    from uvicorn.protocols.http import httptools_impl as uvicorn_http

    from capyctl.adapters.engines import _wire
    from capyctl.adapters.http import chat as door
    from capyctl.adapters.http import exchange
    from capyctl.services import admission, chat, controllers, events, keys

    def on_data(original: Any, label: str) -> Any:
        def wrapped(self: Any, data: bytes) -> Any:
            mark(label)
            return original(self, data)
        return wrapped

    uvicorn_http.HttpToolsProtocol.data_received = on_data(uvicorn_http.HttpToolsProtocol.data_received,
                                                           "client bytes in")
    original_engine_data = _wire._Response.data_received

    def engine_data(self: Any, data: bytes) -> Any:  # the answer's head, then its body (the first chunk)
        mark("engine body in" if self.headers_done else "engine head in")
        return original_engine_data(self, data)

    _wire._Response.data_received = engine_data
    wrap_async(exchange.WireExchange, "run_asgi", "exchange task")
    wrap_sync(uvicorn_http.HttpToolsProtocol, "__init__", "connection's protocol")
    wrap_async(exchange.WireExchange, "write", "send head+chunk / chunk")
    wrap_sync(exchange.WireExchange, "write_now", "send head+chunk / chunk")  # a pumped stream's writes
    wrap_async(exchange.WireExchange, "end", "send end")
    wrap_async(exchange.WireExchange, "read_body", "read body")
    wrap_sync(door.FrontDoor, "begin", "early front")  # as the last byte comes, before the task runs
    wrap_sync(chat.ChatService, "send_now", "send now")
    wrap_sync(_wire.WireEngineSession, "send_now", "engine write now")
    wrap_async(door.FrontDoor, "_handle", "front door")
    wrap_sync(keys.Keyring, "authenticate", "authenticate")
    wrap_sync(door, "decode_body", "decode body")
    wrap_sync(door, "check_scope", "key scope")
    wrap_sync(keys.Keyring, "let_in", "daily limit")
    wrap_async(door.ChatEndpoint, "answer", "endpoint")
    wrap_context(chat.ChatService, "open", "service open")
    wrap_sync(chat, "engine_body", "engine body")
    wrap_context(admission.AdmissionService, "admit", "admission")
    wrap_async(controllers.AttachedController, "route", "route")
    wrap_async(controllers.ManagedController, "route", "route")
    wrap_sync(events.Events, "selection", "selection event")
    wrap_async(_wire.WireEngineSession, "_connection", "engine connection")
    # the first chunk's way from the engine read to the client write
    from capyctl.adapters.engines import _sse
    from capyctl.domain import relay_check

    for owner, name, label in ((_wire._Response, "take", "take"), (_sse, "parse_event", "parse event"),
                               (_sse, "decode_head", "decode head"), (chat._Relay, "step", "relay step"),
                               (relay_check.TypedRelay, "__call__", "typed check"),
                               (door.ChatEndpoint, "_deliver", "deliver"), (door._Framing, "frame", "frame")):
        wrap_sync(owner, name, label)

    def dump(*_: Any) -> None:
        Path(os.environ["STAMP_OUT"]).write_bytes(msgspec.json.encode(STAMPS))
        os._exit(0)

    signal.signal(signal.SIGUSR1, dump)
    sys.argv = ["capyctl", *argv]
    from capyctl.entrypoints.cli.app import main

    main()


def request(port: int, body: bytes, key: str | None) -> tuple[int, int, int, int]:
    """(connect, connected, sent, first data) in perf_counter nanoseconds, for one streamed request."""
    auth = f"Authorization: Bearer {key}\r\n" if key else ""
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n{auth}Content-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    began = time.perf_counter_ns()
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    connected = time.perf_counter_ns()
    sock.sendall(head + body)
    sent = time.perf_counter_ns()
    seen = b""
    while b"data: " not in seen:
        data = sock.recv(65536)
        if not data:
            break
        seen += data
    first = time.perf_counter_ns()
    while sock.recv(65536):
        pass
    sock.close()
    return began, connected, sent, first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--paced", action="store_true", help="the engine waits its recorded time before the first chunk")
    parser.add_argument("--recording", default=str(ROOT / "tests/contract/recordings/vllm/0.32.0"))
    parser.add_argument("--case", default="chat_stream_usage")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    import httpx
    import msgspec

    from tests.integration.harness import free_port

    tmp = Path(tempfile.mkdtemp(prefix="capyctl-ttft-"))
    state, out = tmp / "state", tmp / "stamps.json"
    env = {**os.environ, "CAPYCTL_STATE_DIR": str(state), "STAMP_OUT": str(out)}
    engine = subprocess.Popen([sys.executable, "-m", "capyctl.replay", "--recordings", args.recording, "--port", "0",
                               "--default-case", args.case], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    server = None
    try:
        line = engine.stdout.readline().decode()  # type: ignore[union-attr]
        engine_url = re.search(r"listening on (http://\S+)", line).group(1)  # type: ignore[union-attr]
        port, management = free_port(), free_port()
        with open(tmp / "capyctl.log", "wb") as log:
            server = subprocess.Popen([sys.executable, __file__, "--serve", "start", "standalone", "--listen",
                                       f"127.0.0.1:{port}", "--management", f"127.0.0.1:{management}"],
                                      env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while not (state / "management.json").exists():
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit(f"CapyCTL did not start: {(tmp / 'capyctl.log').read_text()}")
            time.sleep(0.1)
        (tmp / "m.yaml").write_text(f"name: m\nengine: vllm\nendpoint: {engine_url}\nengine_version: 0.32.0\n")
        subprocess.run([sys.executable, "-m", "capyctl", "deploy", "model", "--file", str(tmp / "m.yaml"), "--wait"],
                       env=env, check=True, capture_output=True)
        key = (state / "identity" / "credentials").read_text().split("api_key: ", 1)[1].strip()
        fields = '"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true'
        body = ("{" + fields + (',"replay_pace":"recorded"' if args.paced else "") + "}").encode()
        engine_port = int(engine_url.rsplit(":", 1)[1])
        for _ in range(30):  # warm both paths
            request(port, body, key)
            request(engine_port, body, None)
        direct, relayed = [], []
        for _ in range(args.requests):
            d = request(engine_port, body, None)
            direct.append((d[3] - d[0]) / 1e6)
            relayed.append(request(port, body, key))
            time.sleep(0.005)
        server.send_signal(signal.SIGUSR1)
        server.wait(10)
        stamps = msgspec.json.decode(out.read_bytes())
        httpx.get(engine_url + "/replay/stats", timeout=5)
    finally:
        if server is not None and server.poll() is None:
            server.terminate()
            server.wait(10)
        engine.terminate()
        engine.wait(10)
    report(direct, relayed, stamps)


def report(direct: list[float], relayed: list[tuple[int, int, int, int]], stamps: list[tuple[str, int]]) -> None:
    steps: dict[tuple[str, str], list[float]] = defaultdict(list)
    at: dict[tuple[str, str], list[float]] = defaultdict(list)
    for began, connected, sent, first in relayed:
        inside = [(label, t) for label, t in stamps if began <= t <= first]
        path = [("client connect", began), ("client connected", connected), ("client sent", sent)]
        path += sorted(inside, key=lambda s: s[1])
        path.append(("client first data", first))
        seen: set[str] = set()
        kept = []
        for label, t in path:  # the first time each point is passed
            if label not in seen:
                seen.add(label)
                kept.append((label, t))
        kept.sort(key=lambda s: s[1])
        for (a, ta), (b, tb) in zip(kept, kept[1:]):
            steps[(a, b)].append((tb - ta) / 1000)
            at[(a, b)].append((ta - began) / 1000)
    total = [(first - began) / 1e6 for began, _, _, first in relayed]
    print(f"{len(relayed)} requests: time to first data p50 direct {statistics.median(direct):.3f} ms, "
          f"through CapyCTL {statistics.median(total):.3f} ms, added {statistics.median(total) - statistics.median(direct):.3f} ms")
    print(f"{'step':<58} {'p50 µs':>8} {'at µs':>8} {'seen':>5}")
    common = [(k, v) for k, v in steps.items() if len(v) >= len(relayed) // 2]
    for (a, b), values in sorted(common, key=lambda kv: statistics.median(at[kv[0]])):
        print(f"{a + ' -> ' + b:<58} {statistics.median(values):8.1f} {statistics.median(at[(a, b)]):8.0f} "
              f"{len(values):5d}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(sys.argv[2:])
    else:
        main()
