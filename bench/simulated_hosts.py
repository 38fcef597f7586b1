"""Simulated hosts for the benches of many hosts: CapyCTL's own host agent over the real control link, many in
one process, with or without engines.

Each host joins with CapyCTL's own ``join`` (a key, a CSR, the invitation spent, a certificate kept) and runs
CapyCTL's own ``HostAgent``: mutual TLS to the control listener, hello, inventory (one 80 GiB device), a
heartbeat every second, exactly as ``capyctl start host`` does, without an ingress. With ``engines``, the
agent answers the server's commands with the host's own ``host_commands`` and ``HostEngines`` (launch, probe,
load, stop, the engine inspection), over engines that are not processes: ``SimulatedEngine`` answers ready
at once and reports a running and waiting count and a KV use drawn at random on each read, so that the
server's balancing has varied loads to weigh.

Run alone (``python bench/simulated_hosts.py JOINS ROOT [--engines]``) it joins every host of the JSON list of
join files ``JOINS`` (what ``POST /hosts/invites`` answers), keeps them linked until SIGTERM, and writes
``ROOT/ready`` once every agent runs: how ``bench/route.py`` puts its hosts in a process of their own.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import msgspec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from capyctl.adapters.clock import SystemClock  # noqa: E402
from capyctl.adapters.control.host_agent import HostAgent, join  # noqa: E402
from capyctl.domain.joining import JoinFile  # noqa: E402
from capyctl.domain.link import DeviceReport, Inventory  # noqa: E402
from capyctl.domain.ports import EngineLoad  # noqa: E402
from capyctl.entrypoints.host_role import host_commands  # noqa: E402
from capyctl.services.host_engines import HostEngines  # noqa: E402
from tests.fakes.ports import FakeEngineAdapter, FakeProcessControl  # noqa: E402

GiB = 1 << 30
INVENTORY = Inventory(devices=[DeviceReport(name="gpu0", capacity=80 * GiB, reserve=0)])


class SimulatedEngine(FakeEngineAdapter):
    """An engine family the server knows (llama.cpp's) that is no process: ready at once, its load drawn at
    random on each read (0-7 running, 0-3 waiting, KV use 0-100 %)."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self._random = random.Random(seed)

    async def load(self, base_url: str) -> EngineLoad | None:
        draw = self._random
        return EngineLoad(draw.randrange(8), draw.randrange(4), draw.random())


class _NoGates:
    """No ingress: the gates a launch opens lead nowhere (nothing is relayed to a simulated engine)."""

    def open_gate(self, key: str, port: int) -> None:
        pass

    def close_gate(self, key: str) -> None:
        pass


def agent_for(
    state: Path, engines: bool, seed: int, ports: itertools.count[int]
) -> tuple[HostAgent, HostEngines | None]:
    """The host agent of the host that joined into ``state``; with ``engines``, one that runs them (and its
    engines, whose loads it reports every second as ``capyctl start host`` does)."""
    if not engines:
        return HostAgent(state, lambda: INVENTORY), None
    adapters: dict[str, Any] = {"llamacpp": SimulatedEngine(seed)}
    gates: Any = _NoGates()  # where host_commands wants the ingress: its gates are all a launch touches
    run = HostEngines(adapters, FakeProcessControl(), SystemClock(), lambda: next(ports), state / "logs", gates)
    commands = host_commands(gates, run, adapters)
    return HostAgent(state, lambda: INVENTORY, commands, ingress_port=1, running=run.running), run


async def simulate(joins: Sequence[JoinFile], root: Path, engines: bool, ready: anyio.Event) -> None:
    """Every host of ``joins`` joined (its state under ``root``) and linked; ``ready`` set once each agent
    runs; runs until cancelled."""
    stopping = anyio.Event()
    ports = itertools.count(20000)
    agents = []
    for i, join_file in enumerate(joins):
        state = root / join_file.host
        await join(join_file, state)
        agents.append(agent_for(state, engines, i, ports))
    async with anyio.create_task_group() as tg:
        for agent, run in agents:
            tg.start_soon(agent.run, stopping)
            if run is not None:
                tg.start_soon(run.report_loads, agent.tell)
        ready.set()
        await anyio.sleep_forever()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("joins", type=Path, help="a JSON list of join files (what POST /hosts/invites answers)")
    parser.add_argument("root", type=Path, help="where each host keeps its state; ROOT/ready is written once linked")
    parser.add_argument("--engines", action="store_true", help="answer the server's engine commands")
    args = parser.parse_args()
    joins = msgspec.convert(json.loads(args.joins.read_text()), list[JoinFile])

    async def run() -> None:
        ready = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(simulate, joins, args.root, args.engines, ready)
            await ready.wait()
            (args.root / "ready").write_text("ready\n")
            with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                async for _ in signals:
                    break
            tg.cancel_scope.cancel()

    anyio.run(run)


if __name__ == "__main__":
    main()
