"""An idle server with many hosts: its CPU and memory while ``--hosts`` simulated hosts keep their control links
up and heartbeat, and how long listing them takes.

    .venv/bin/python bench/fleet_idle.py [--hosts 100] [--seconds 20]

The server is ``capyctl start server`` (its own process, control listener on loopback). The hosts are simulated
in one other process (this script): each is invited through the management API (``POST /hosts/invites``),
then joins and links as ``bench/simulated_hosts.py`` describes (CapyCTL's own ``join`` and ``HostAgent``:
mutual TLS, hello, inventory, a heartbeat every second), without engines or an ingress. Once every host reads
``online``, the server's CPU time (user + system, from ``/proc``) is read over ``--seconds`` of idle links;
printed: CPU as a share of one core, RSS, and ``GET /hosts`` (the management API, what ``capyctl list hosts``
asks) p50 over 10 calls, with the CLI's whole run beside it (its Python start included).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import anyio
import httpx
import msgspec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import simulated_hosts  # noqa: E402
from capyctl.domain.joining import JoinFile  # noqa: E402
from tests.integration.harness import free_port  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def start_server(state: Path) -> tuple[subprocess.Popen[bytes], httpx.Client, int]:
    control = free_port()
    state.mkdir(parents=True)
    log = open(state.parent / "server.log", "wb")  # noqa: SIM115 - open for the server's whole life
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "capyctl",
            "start",
            "server",
            "--listen",
            f"127.0.0.1:{free_port()}",
            "--management",
            f"127.0.0.1:{free_port()}",
            "--control-listen",
            f"127.0.0.1:{control}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "CAPYCTL_STATE_DIR": str(state)},
    )
    deadline = time.monotonic() + 60
    while not (state / "management.json").exists():
        if process.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the server did not start: {(state.parent / 'server.log').read_text()[-2000:]}")
        time.sleep(0.1)
    info = json.loads((state / "management.json").read_text())
    token = (state / "identity" / "admin-token").read_text().strip()
    client = httpx.Client(base_url=info["url"], headers={"authorization": f"Bearer {token}"}, timeout=60)
    return process, client, control


async def simulate(client: httpx.Client, count: int, control: int, root: Path, ready: anyio.Event) -> None:
    """``count`` hosts invited, joined and linked (``bench/simulated_hosts.py``, no engines); ``ready`` set
    once they are; runs until cancelled."""
    joins = []
    for i in range(count):
        answer = client.post(
            "/hosts/invites", json={"name": f"sim-{i:04d}", "ttl_s": 3600, "server": f"127.0.0.1:{control}"}
        )
        if answer.status_code != 201:
            raise RuntimeError(f"POST /hosts/invites answered {answer.status_code}: {answer.text[:300]}")
        joins.append(msgspec.convert(answer.json(), JoinFile))
    await simulated_hosts.simulate(joins, root, False, ready)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="capyctl-fleet-") as tmp:
        root = Path(tmp)
        process, client, control = start_server(root / "server")
        try:
            result: dict[str, float] = {}

            async def run() -> None:
                ready = anyio.Event()
                async with anyio.create_task_group() as tg:
                    began = time.monotonic()
                    tg.start_soon(simulate, client, args.hosts, control, root / "hosts", ready)
                    await ready.wait()
                    while True:
                        states = [h["state"] for h in (await anyio.to_thread.run_sync(client.get, "/hosts")).json()]
                        if states.count("online") == args.hosts:
                            break
                        await anyio.sleep(0.5)
                    result["linked_s"] = time.monotonic() - began
                    await anyio.sleep(3)  # what linking stirred up settles
                    cpu0, wall0 = cpu_seconds(process.pid), time.monotonic()
                    await anyio.sleep(args.seconds)
                    result["cpu"] = (cpu_seconds(process.pid) - cpu0) / (time.monotonic() - wall0)
                    result["rss"] = rss_bytes(process.pid)
                    lists = []
                    for _ in range(10):
                        t0 = time.perf_counter()
                        listed = await anyio.to_thread.run_sync(client.get, "/hosts")
                        lists.append(time.perf_counter() - t0)
                        assert len(listed.json()) == args.hosts
                    result["list_ms"] = statistics.median(lists) * 1000
                    t0 = time.perf_counter()
                    done = await anyio.to_thread.run_sync(
                        lambda: subprocess.run(
                            [sys.executable, "-m", "capyctl", "list", "hosts", "--json"],
                            capture_output=True,
                            env={**os.environ, "CAPYCTL_STATE_DIR": str(root / "server")},
                        )
                    )
                    result["cli_ms"] = (time.perf_counter() - t0) * 1000
                    assert done.returncode == 0, done.stderr
                    tg.cancel_scope.cancel()

            anyio.run(run)
        finally:
            process.terminate()
            process.wait(30)
    print(
        f"{args.hosts} hosts linked in {result['linked_s']:.1f} s; idle for {args.seconds:g} s: server CPU "
        f"{result['cpu'] * 100:.1f} % of one core, RSS {result['rss'] / 2**20:.0f} MiB; GET /hosts p50 "
        f"{result['list_ms']:.1f} ms; capyctl list hosts --json {result['cli_ms']:.0f} ms (Python start included)"
    )


if __name__ == "__main__":
    main()
