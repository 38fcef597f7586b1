"""A host's engines (``services/host_engines.py``), on fake processes and a fake engine adapter, in virtual
time: the loads of all its engines reported in one message a second."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

from capyctl.domain.deployments import DeploymentSpec
from capyctl.domain.link import Command, LoadSample, Message
from capyctl.domain.ports import EngineLoad
from capyctl.services.host_engines import LOADS_EVERY, HostEngines
from tests.fakes.hosts import ENGINE
from tests.fakes.ports import FakeEngineAdapter, FakeProcessControl, VirtualClock, virtual_time

pytestmark = pytest.mark.anyio
anyio_backend = pytest.fixture(virtual_time)


class Gates:
    def open_gate(self, key: str, port: int) -> None:
        pass

    def close_gate(self, key: str) -> None:
        pass


class Loads(FakeEngineAdapter):
    """Each engine's load by its port; a port missing from ``by_port`` fails its read."""

    def __init__(self) -> None:
        super().__init__()
        self.by_port: dict[int, EngineLoad] = {}

    async def load(self, base_url: str) -> EngineLoad | None:
        return self.by_port[int(base_url.rsplit(":", 1)[1])]


def launch(instance: str, generation: int) -> Command:
    spec = DeploymentSpec(name=instance.partition("/")[0], engine="e", model="/m.gguf")
    args: dict[str, Any] = {
        "spec": msgspec.to_builtins(spec),
        "engine": msgspec.to_builtins(ENGINE),
        "gate": "g" * 24,
    }
    return Command(id=f"c{generation}", generation=generation, instance=instance, action="launch", args=args)


async def test_every_engines_load_is_reported_in_one_message_a_second_a_failed_read_left_out(tmp_path: Path) -> None:
    adapter = Loads()
    ports = iter(range(7001, 7010))
    engines = HostEngines(
        {"llamacpp": adapter}, FakeProcessControl(), VirtualClock(), lambda: next(ports), tmp_path, Gates()
    )
    told: list[Message] = []

    async def tell(message: Message) -> None:
        told.append(message)

    async with anyio.create_task_group() as tg:
        tg.start_soon(engines.report_loads, tell)
        await anyio.sleep(LOADS_EVERY * 3.5)
        assert told == []  # no engine: nothing to tell
        for instance, generation in (("chat", 1), ("chat/1", 2), ("chat/2", 3)):
            await engines.handle(launch(instance, generation))
        adapter.by_port = {7001: EngineLoad(3, 1, 0.5), 7002: EngineLoad(0, 0)}  # chat/2's read fails
        await anyio.sleep(LOADS_EVERY)
        (sample,) = told
        assert isinstance(sample, LoadSample)
        assert [(x.instance, x.running, x.waiting, x.kv_usage) for x in sample.loads] == [
            ("chat", 3, 1, 0.5),
            ("chat/1", 0, 0, None),
        ]
        await engines.handle(Command(id="s", generation=2, instance="chat/1", action="stop", args={"grace": 0}))
        adapter.by_port[7003] = EngineLoad(5, 0)
        await anyio.sleep(LOADS_EVERY)
        assert [x.instance for x in told[-1].loads] == ["chat", "chat/2"]  # type: ignore[attr-defined]
        assert len(told) == 2  # one message a second, however many engines
        tg.cancel_scope.cancel()
