"""Route decision benchmark: how long the router takes to pick an instance for a request, with a large fleet
of hosts linked over the real control link.

    .venv/bin/python bench/route.py [--hosts 100] [--deployments 10] [--instances 3] [--picks 200000]

The server is CapyCTL's own, composed as ``capyctl start server`` composes it (``entrypoints/service.py``),
run in this process so that its router can be timed. Its hosts are ``--hosts`` simulated hosts
(``bench/simulated_hosts.py``) in a process of their own: each joins with an invitation and keeps its mutual
TLS link up with CapyCTL's own host agent, and runs its engines with CapyCTL's own ``HostEngines`` over
engines that are not processes (ready at once, loads drawn at random, read by the server every second as it
reads real ones). Each host gets an engine (``POST /hosts/NAME/engines``); then ``--deployments`` deployments
per host (1,000 for 100 hosts), each of ``--instances`` instances placed by the server's own placement
(spread), are deployed through the management API and started; each instance is launched, probed ready and
sampled over the link. Beside them, one deployment of one instance: the path a lone instance takes, timed in
the same run as the baseline.

Once every instance reads ready and has a fresh load sample, ``Router.pick`` (what every request asks first)
is timed with ``perf_counter_ns`` around each call, for ``--picks`` requests, each for a deployment drawn at
random, in batches of 1,000 between which the server's event loop runs (the links' heartbeats and load
samples go on while it is timed, as they do under requests). Printed: p50, p99, p99.9 and the mean, in
microseconds, for the large fleet and for the lone instance.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
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

from capyctl.domain.limits import across_hosts  # noqa: E402
from capyctl.entrypoints import service  # noqa: E402
from capyctl.services.routing import Router  # noqa: E402
from tests.integration.harness import free_port  # noqa: E402

BATCH = 1000  # picks between two turns of the event loop


def percentiles(samples: list[int]) -> tuple[float, float, float]:
    ordered = sorted(samples)
    n = len(ordered)
    return tuple(ordered[min(n - 1, int(q * n))] / 1000 for q in (0.5, 0.99, 0.999))  # type: ignore[return-value]


async def time_picks(router: Router, names: list[str], picks: int) -> list[int]:
    draw = [random.choice(names) for _ in range(picks)]
    out: list[int] = []
    timer = time.perf_counter_ns
    for start in range(0, picks, BATCH):
        for name in draw[start : start + BATCH]:
            began = timer()
            router.pick(name, "chat")
            out.append(timer() - began)
        await anyio.sleep(0)  # the server's own work between batches: heartbeats, samples
    return out


async def poll(what: str, check, timeout: float) -> None:  # type: ignore[no-untyped-def]
    """Waits until ``check()`` (awaited) is true, at most ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not await check():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}: not within {timeout:g} s")
        await anyio.sleep(0.5)


async def bench(args: argparse.Namespace, root: Path) -> dict[str, object]:
    state = root / "server"
    settings = msgspec.structs.replace(service.DEFAULTS, limits=across_hosts(service.DEFAULTS.limits))
    container = service.build_container(state, settings, several=True)
    container.init_resources()
    control = free_port()
    listen = ("127.0.0.1", free_port())
    management = ("127.0.0.1", free_port())
    result: dict[str, object] = {}
    hosts_process: subprocess.Popen[bytes] | None = None
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(
                service._serve,  # the server's own composition, as serve_server runs it, its container here
                container,
                listen,
                management,
                settings.limits,
                (("127.0.0.1", control), f"127.0.0.1:{control}"),
            )
            await poll("the server starts", lambda: anyio.to_thread.run_sync((state / "management.json").exists), 60)
            url = json.loads((state / "management.json").read_text())["url"]
            token = (state / "identity" / "admin-token").read_text().strip()
            async with httpx.AsyncClient(
                base_url=url, headers={"authorization": f"Bearer {token}"}, timeout=120
            ) as api:
                began = time.monotonic()
                names = [f"sim-{i:04d}" for i in range(args.hosts)]
                joins = []
                for name in names:
                    invite = await api.post(
                        "/hosts/invites", json={"name": name, "ttl_s": 3600, "server": f"127.0.0.1:{control}"}
                    )
                    assert invite.status_code == 201, invite.text
                    joins.append(invite.json())
                (root / "joins.json").write_text(json.dumps(joins))
                hosts_process = subprocess.Popen(
                    [
                        sys.executable,
                        str(ROOT / "bench" / "simulated_hosts.py"),
                        str(root / "joins.json"),
                        str(root / "hosts"),
                        "--engines",
                    ],
                    stdout=open(root / "hosts.log", "wb"),  # noqa: SIM115 - for the hosts' whole life
                    stderr=subprocess.STDOUT,
                )

                async def all_online() -> bool:
                    listed = (await api.get("/hosts")).json()
                    return [h["state"] for h in listed].count("online") == args.hosts

                await poll("every host links", all_online, 120)
                for name in names:
                    added = await api.post(f"/hosts/{name}/engines", json={"path": sys.executable, "name": "sim"})
                    assert added.status_code == 201, added.text
                result["linked_s"] = time.monotonic() - began

                began = time.monotonic()
                deployments = [f"m{i:05d}" for i in range(args.hosts * args.deployments)]
                documents = [
                    {"name": n, "engine": "sim", "model": sys.executable, "instances": args.instances}
                    for n in deployments
                ] + [{"name": "lone", "engine": "sim", "model": sys.executable, "placement": {"hosts": [names[0]]}}]
                for document in documents:
                    applied = await api.put("/deployments", json={"document": document, "activate": True})
                    assert applied.status_code == 200, applied.text
                fleet = container.fleet()
                clock = container.clock()

                async def all_sampled() -> bool:
                    now = clock.monotonic()
                    members = [m for d in fleet.deployments() for m in d.members]
                    ready = [m for m in members if m.route_now() is not None and m.held() is None]
                    sampled = [m for m in ready if m.sample is not None and now - m.sample.at < 3]
                    result["instances"] = len(members)
                    return len(ready) == len(members) and len(sampled) >= len(members) - 1  # the lone: no samples

                await poll("every instance is ready and sampled", all_sampled, 600)
                result["deployed_s"] = time.monotonic() - began
                cpu0, wall0 = time.process_time(), time.monotonic()  # this process is the server
                await anyio.sleep(args.idle)
                result["idle_cpu"] = (time.process_time() - cpu0) / (time.monotonic() - wall0)
                router = container.router()
                result["large"] = await time_picks(router, deployments, args.picks)
                result["lone"] = await time_picks(router, ["lone"], args.picks)
                result["failovers"] = sum(router.failovers.values())
            tg.cancel_scope.cancel()
    finally:
        if hosts_process is not None:
            hosts_process.send_signal(signal.SIGTERM)
            try:
                hosts_process.wait(30)
            except subprocess.TimeoutExpired:
                hosts_process.kill()
        container.shutdown_resources()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=100)
    parser.add_argument("--deployments", type=int, default=10, help="deployments per host")
    parser.add_argument("--instances", type=int, default=3)
    parser.add_argument("--picks", type=int, default=200_000)
    parser.add_argument("--idle", type=float, default=10.0, help="seconds the idle server's CPU is read over")
    args = parser.parse_args()
    random.seed(43)
    with tempfile.TemporaryDirectory(prefix="capyctl-route-") as tmp:
        result = anyio.run(bench, args, Path(tmp))
    print(
        f"{args.hosts} hosts linked over the control link in {result['linked_s']:.1f} s; "
        f"{args.hosts * args.deployments} deployments of {args.instances} + 1 of one: {result['instances']} instances "
        f"ready and sampled in {result['deployed_s']:.1f} s; {args.picks} picks each"
    )
    print(
        f"  the server idle over {args.idle:g} s, its hosts heartbeating and each instance's load read every second: "
        f"CPU {result['idle_cpu'] * 100:.1f} % of one core"
    )
    for label, key in ((f"{args.instances} instances, large fleet", "large"), ("1 instance, 1 deployment", "lone")):
        samples: list[int] = result[key]  # type: ignore[assignment]
        p50, p99, p999 = percentiles(samples)
        mean = statistics.fmean(samples) / 1000
        print(f"  {label:<34} p50 {p50:6.2f} us  p99 {p99:6.2f} us  p99.9 {p999:6.2f} us  mean {mean:6.2f} us")


if __name__ == "__main__":
    main()
