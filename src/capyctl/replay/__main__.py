"""``python -m capyctl.replay`` / ``capyctl-replay``: serve one recording folder as an engine would."""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
from pathlib import Path

import uvicorn

from capyctl.replay import DIALECTS
from capyctl.replay.app import ReplayApp
from capyctl.replay.recordings import load


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="capyctl-replay", description=__doc__)
    p.add_argument("--dialect", choices=DIALECTS, help="engine family to mimic (default: the folder's engine)")
    p.add_argument("--version", help="engine version to report (default: the folder name)")
    p.add_argument("--recordings", required=True, type=Path, help="one <engine>/<version> recording folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", required=True, type=int, help="0: pick a free port (printed on start)")
    p.add_argument(
        "--pace",
        choices=("recorded", "fast"),
        default="fast",
        help="recorded: the folder's first_chunk_ms / interval_ms; fast: no waits (default)",
    )
    p.add_argument(
        "--default-case",
        help="case served when a request names none (default: chat_stream_usage, else the first ok stream)",
    )
    return p.parse_args(argv)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


async def _serve(server: uvicorn.Server, sock: socket.socket, banner: str) -> None:
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.005)
    if server.started:
        print(banner, flush=True)
    await task


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        recording = load(args.recordings)
        dialect = args.dialect or recording.engine
        if dialect not in DIALECTS:
            raise ValueError(f"unknown dialect {dialect!r}; pass --dialect")
        version = args.version or recording.path.name
        app = ReplayApp(recording, dialect, version, pace=args.pace, default_case=args.default_case)
        sock = _bind(args.host, args.port)
    except (OSError, ValueError) as exc:
        print(f"replay: {exc}", file=sys.stderr, flush=True)
        return 2
    port = sock.getsockname()[1]
    host = f"[{args.host}]" if ":" in args.host else args.host
    banner = f"replay: listening on http://{host}:{port} ({dialect}, {version}, {len(recording.cases)} cases)"
    config = uvicorn.Config(
        app,
        lifespan="off",
        log_level="warning",
        access_log=False,
        backlog=4096,
        timeout_keep_alive=30,
        timeout_graceful_shutdown=1,
        server_header=dialect in ("vllm", "sglang", "tensorfold"),
    )
    server = uvicorn.Server(config)
    try:
        with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
            runner.run(_serve(server, sock, banner))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
