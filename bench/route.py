"""Route decision benchmark: how long the router takes to pick an instance for a request, with a large fleet
registered, in one process.

    .venv/bin/python bench/route.py [--hosts 100] [--deployments 10] [--instances 3] [--picks 200000]

The fleet is CapyCTL's own (``services/fleet.py``): ``--hosts`` hosts (the tests' fake registry of hosts,
``tests/fakes/hosts.py``: each host answers the server's commands at once, no network), each with one engine,
and ``--deployments`` deployments per host's worth of deployments, each with ``--instances`` instances spread
over the hosts by placement: 100 hosts x 10 x 3 is 1,000 deployments and 3,000 instances, every one launched
and ready (its engine's load sample fresh, in-flight counts varied). Then ``Router.pick`` (what every request
asks) is timed for ``--picks`` requests, each for a deployment drawn at random, with ``perf_counter_ns``
around each call. Printed: the picks' p50, p99 and p99.9 in microseconds, and the same for a fleet of one
deployment of one instance (the path a single instance takes) as a baseline in the same run.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import anyio

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from capyctl.domain.balancing import Sample  # noqa: E402
from capyctl.domain.deployments import InstanceState  # noqa: E402
from capyctl.services.controllers import ControllerSettings  # noqa: E402
from capyctl.services.events import Events  # noqa: E402
from capyctl.services.fleet import Fleet  # noqa: E402
from capyctl.services.routing import Router  # noqa: E402
from tests.fakes.hosts import FakeRegistry  # noqa: E402
from tests.fakes.ports import FakeClock, FakeEngineAdapter, FakeProcessControl, FakeStore  # noqa: E402


def percentiles(samples: list[int]) -> tuple[float, float, float]:
    ordered = sorted(samples)
    n = len(ordered)
    return tuple(ordered[min(n - 1, int(q * n))] / 1000 for q in (0.5, 0.99, 0.999))  # type: ignore[return-value]


async def build(hosts: int, deployments: int, instances: int, tmp: Path) -> tuple[Fleet, list[str], FakeClock]:
    """A fleet of ``hosts`` x ``deployments`` deployments of ``instances`` each, all ready."""
    clock = FakeClock()
    store = FakeStore()
    registry = FakeRegistry(*(f"h{i:04d}" for i in range(hosts)))
    ports = itertools.count(6000)
    fleet = Fleet(
        store,
        {"llamacpp": FakeEngineAdapter()},
        FakeProcessControl(),
        clock,  # type: ignore[arg-type]
        Events(store, clock),  # type: ignore[arg-type]
        lambda: next(ports),
        tmp / "logs",
        ControllerSettings(),
        hosts=registry,  # type: ignore[arg-type]
    )
    names = []
    async with anyio.create_task_group() as tg:
        await tg.start(fleet.run)
        for i in range(hosts * deployments):
            name = f"m{i:05d}"
            names.append(name)
            found = (await fleet.apply({"name": name, "engine": "e", "model": "/m", "instances": instances}, False))[1]
            for member in found.members:  # ready at once: what is timed is the choice, not a start
                member.status.state = InstanceState.READY
                member.in_flight = random.randrange(0, 8)
                member.sample = Sample(random.randrange(0, 8), random.randrange(0, 4), clock.monotonic())
        tg.cancel_scope.cancel()
    return fleet, names, clock


def time_picks(router: Router, names: list[str], picks: int) -> list[int]:
    draw = [random.choice(names) for _ in range(picks)]
    out = []
    timer = time.perf_counter_ns
    for name in draw:
        began = timer()
        router.pick(name, "chat")
        out.append(timer() - began)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=100)
    parser.add_argument("--deployments", type=int, default=10, help="deployments per host's worth")
    parser.add_argument("--instances", type=int, default=3)
    parser.add_argument("--picks", type=int, default=200_000)
    args = parser.parse_args()
    random.seed(43)
    with tempfile.TemporaryDirectory(prefix="capyctl-route-") as tmp:
        began = time.monotonic()
        fleet, names, clock = anyio.run(build, args.hosts, args.deployments, args.instances, Path(tmp))
        built = time.monotonic() - began
        one, single, _ = anyio.run(build, 1, 1, 1, Path(tmp) / "one")
        counted = sum(len(f.members) for f in fleet.deployments())
        print(
            f"fleet: {args.hosts} hosts, {len(names)} deployments, {counted} instances "
            f"(built in {built:.1f} s); {args.picks} picks each"
        )
        big = time_picks(Router(fleet, clock, 32), names, args.picks)  # type: ignore[arg-type]
        small = time_picks(Router(one, clock, 32), single, args.picks)  # type: ignore[arg-type]
    for label, samples in ((f"{args.instances} instances, large fleet", big), ("1 instance, 1 deployment", small)):
        p50, p99, p999 = percentiles(samples)
        mean = statistics.fmean(samples) / 1000
        print(f"  {label:<34} p50 {p50:6.2f} us  p99 {p99:6.2f} us  p99.9 {p999:6.2f} us  mean {mean:6.2f} us")


if __name__ == "__main__":
    main()
