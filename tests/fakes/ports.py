"""In-memory fakes of the ports, with observable state."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import trio
import trio.testing

from capyctl.domain.deployments import Deployment, DeploymentSpec
from capyctl.domain.engines import EngineInstall
from capyctl.domain.hosts import HostRecord
from capyctl.domain.joining import Invite
from capyctl.domain.keys import ApiKey
from capyctl.domain.ports import EngineLoad


class FakeClock:
    """A clock that stands still unless the test moves it (``now``); it never reads real time."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def wall(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now


class VirtualClock:
    """Trio's virtual time as CapyCTL's clock: with ``virtual_time`` as the anyio backend, every sleep,
    timeout and reading of this clock is on a clock that jumps ahead whenever all tasks wait, so a
    test of timing rules runs at once, the same way each time, and never reads real time."""

    EPOCH = 1_000_000.0

    def wall(self) -> float:
        return self.EPOCH + trio.current_time()

    def monotonic(self) -> float:
        return trio.current_time()


def virtual_time() -> tuple[str, dict[str, Any]]:
    """An ``anyio_backend`` value: trio, on a fresh mock clock that jumps whenever every task waits."""
    return "trio", {"clock": trio.testing.MockClock(autojump_threshold=0)}


class FakeStore:
    def __init__(self) -> None:
        self.engines: dict[str, EngineInstall] = {}
        self.deployments: dict[str, Deployment] = {}
        self.events: list[dict[str, Any]] = []
        self.keys: dict[str, tuple[ApiKey, float | None]] = {}
        self.usage: dict[tuple[str, str], int] = {}
        self.meta: dict[str, str] = {}
        self.hosts: dict[str, HostRecord] = {}
        self.invites: dict[str, Invite] = {}

    def list_keys(self) -> list[tuple[ApiKey, float | None]]:
        return sorted(self.keys.values(), key=lambda entry: entry[0].name)

    def add_key(self, key: ApiKey) -> None:
        assert all(k.name != key.name for k, _ in self.keys.values())
        self.keys[key.id] = (key, None)

    def delete_key(self, key_id: str) -> None:
        self.keys.pop(key_id, None)
        self.usage = {k: v for k, v in self.usage.items() if k[0] != key_id}

    def key_usage(self, day: str) -> dict[str, int]:
        return {key_id: used for (key_id, on), used in self.usage.items() if on == day}

    def note_key_use(self, key_id: str, day: str, used: int, last_used: float | None) -> None:
        if key_id in self.keys:
            self.usage[(key_id, day)] = used
            self.keys[key_id] = (self.keys[key_id][0], last_used)

    def get_meta(self, name: str) -> str | None:
        return self.meta.get(name)

    def set_meta(self, name: str, value: str) -> None:
        self.meta[name] = value

    def put_engine(self, engine: EngineInstall) -> None:
        self.engines[engine.name] = engine

    def get_engine(self, name: str) -> EngineInstall | None:
        return self.engines.get(name)

    def list_engines(self) -> list[EngineInstall]:
        return list(self.engines.values())

    def delete_engine(self, name: str) -> None:
        self.engines.pop(name, None)

    def put_deployment(self, deployment: Deployment) -> None:
        self.deployments[deployment.spec.name] = deployment

    def get_deployment(self, name: str) -> Deployment | None:
        return self.deployments.get(name)

    def list_deployments(self) -> list[Deployment]:
        return list(self.deployments.values())

    def delete_deployment(self, name: str) -> None:
        self.deployments.pop(name, None)

    def add_event(self, at: float, deployment: str | None, kind: str, detail: dict[str, Any]) -> None:
        self.events.append(
            {"id": len(self.events) + 1, "at": at, "deployment": deployment, "kind": kind, "detail": detail}
        )

    def list_events(self, deployment: str | None, after_id: int, limit: int) -> list[dict[str, Any]]:
        rows = [e for e in self.events if e["id"] > after_id and deployment in (None, e["deployment"])]
        return rows[:limit]

    def kinds(self) -> list[str]:
        return [e["kind"] for e in self.events]

    def put_host(self, host: HostRecord) -> None:
        self.hosts[host.name] = host

    def list_hosts(self) -> list[HostRecord]:
        return [self.hosts[name] for name in sorted(self.hosts)]

    def put_invite(self, invite: Invite) -> None:
        self.invites[invite.secret_hash] = invite

    def get_invite(self, secret_hash: str) -> Invite | None:
        return self.invites.get(secret_hash)

    def prune_invites(self, before: float) -> None:
        for key, invite in list(self.invites.items()):
            if min(invite.expires_at, invite.used_at or invite.expires_at) < before:
                del self.invites[key]


class FakeProcess:
    _next_pid = 1000

    def __init__(self, argv: Sequence[str], stop_takes: float = 0.0) -> None:
        FakeProcess._next_pid += 1
        self.pid = FakeProcess._next_pid
        self.argv = list(argv)
        self.code: int | None = None
        self.terminated = False
        self.stop_takes = stop_takes  # seconds between SIGTERM and the exit

    def returncode(self) -> int | None:
        return self.code

    def crash(self, code: int = -9) -> None:
        self.code = code

    async def terminate(self, grace: float) -> int:
        self.terminated = True
        if self.code is None:
            if self.stop_takes:
                await anyio.sleep(self.stop_takes)
            self.code = -15
        return self.code


class FakeProcessControl:
    def __init__(self) -> None:
        self.spawned: list[FakeProcess] = []
        self.exit_at_once = False
        self.stop_takes = 0.0

    async def spawn(self, argv: Sequence[str], log_path: Path, env: dict[str, str | None] | None) -> FakeProcess:
        process = FakeProcess(argv, self.stop_takes)
        if self.exit_at_once:
            process.code = 1
        self.spawned.append(process)
        return process

    def running(self) -> list[FakeProcess]:
        return [p for p in self.spawned if p.code is None]


class FakeEngineAdapter:
    family = "llamacpp"
    owned_options = {"--port": "the port CapyCTL picks"}
    owned_env: tuple[str, ...] = ("SECRET_",)

    def __init__(self) -> None:
        self.healthy = True
        self.probed: list[Path] = []
        self.calls: list[str] = []
        self.sleeping: bool | None = False

    def recognises(self, path: Path) -> bool:
        return True

    def environment(self, engine: EngineInstall, spec: DeploymentSpec) -> dict[str, str | None]:
        return {}

    async def probe_version(self, base_url: str) -> str | None:
        return None

    def probe(self, path: Path) -> tuple[str, str]:
        self.probed.append(path)
        return "0.6.0", "version: 0.6.0-dev (build 0, commit unknown)"

    def command(self, engine: EngineInstall, spec: DeploymentSpec, port: int) -> list[str]:
        return [engine.path, "--port", str(port), *spec.engine_config.extra_args]

    def serves_decisions(self, engine: EngineInstall) -> bool:
        return True

    async def ready(self, base_url: str) -> bool:
        return self.healthy

    async def load(self, base_url: str) -> EngineLoad | None:
        return EngineLoad(0, 0)

    # parking: each call is recorded in ``calls``; ``sleeping`` is what the engine says of itself
    async def park(self, base_url: str, residency: Any) -> None:
        self.calls.append(f"park {residency}")
        self.sleeping = True

    async def wake(self, base_url: str, residency: Any, model: str) -> None:
        self.calls.append(f"wake {residency}")
        self.sleeping = False

    async def parked(self, base_url: str) -> bool | None:
        return self.sleeping


def keyring_with(token: str, clock: Any = None) -> Any:
    """A keyring on a fake store whose key named default is ``token`` (as if read from identity/credentials)."""
    from capyctl.services.events import Events
    from capyctl.services.keys import Keyring

    store = FakeStore()
    clock = clock or FakeClock()
    keyring = Keyring(store, clock, Events(store, clock))
    keyring.bootstrap(token, lambda _: None)
    return keyring
