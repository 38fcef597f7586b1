"""The composition root: the one place where CapyCTL's object graphs are built, the server's (``Container``:
``start standalone``, ``start server``) and a host's (``HostContainer``: ``start host``).

Flat on purpose: constructor calls only. Tests override providers with fakes
(``container.processes.override(...)``). Nothing outside ``entrypoints/``
imports this module or dependency-injector.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dependency_injector import containers, providers

from capyctl.adapters.clock import SystemClock
from capyctl.adapters.control.host_agent import HostIdentity
from capyctl.adapters.control.host_ingress import Ingress
from capyctl.adapters.engines._wire import WireEngineSession
from capyctl.adapters.engines.llamacpp import LlamaCppEngine
from capyctl.adapters.engines.sglang import SglangEngine
from capyctl.adapters.engines.tensorfold import TensorfoldEngine
from capyctl.adapters.engines.vllm import VllmEngine
from capyctl.adapters.http.chat import ChatEndpoint
from capyctl.adapters.http.decisions import DecisionEndpoint
from capyctl.adapters.http.front import FrontDoor
from capyctl.adapters.http.prometheus import RequestStats
from capyctl.adapters.log_format import routine_line
from capyctl.adapters.process.children import PopenProcessControl
from capyctl.adapters.process.ports import free_port
from capyctl.adapters.storage.sqlite import SqliteStore
from capyctl.adapters.storage.state_dir import StateDir
from capyctl.domain.ports import EngineAdapter
from capyctl.domain.request_rows import RecordSettings
from capyctl.domain.scheduling import QueueLimits
from capyctl.entrypoints.host_role import host_commands
from capyctl.services.admission import AdmissionService
from capyctl.services.canary import Canary
from capyctl.services.chat import ChatService
from capyctl.services.controllers import ControllerSettings
from capyctl.services.decisions import DecisionService
from capyctl.services.events import Events
from capyctl.services.fleet import Fleet
from capyctl.services.host_engines import HostEngines
from capyctl.services.keys import Keyring
from capyctl.services.request_log import RequestLog
from capyctl.services.requests import RequestSettings
from capyctl.services.routing import Router
from capyctl.services.server_hosts import HostRegistry
from capyctl.services.switching import Switchboard


def open_store(state_dir: StateDir) -> Iterator[SqliteStore]:
    state_dir.prepare()
    store = SqliteStore(state_dir.database)
    try:
        yield store
    finally:
        store.close()


def log_root(state_dir: StateDir) -> Path:
    return state_dir.root / "logs"


def open_keyring(store: SqliteStore, clock: SystemClock, events: Events, state_dir: StateDir) -> Keyring:
    """The named keys; on the first start the key named default is made and written to identity/credentials,
    and a state directory from before named keys keeps its key as the key named default."""
    keyring = Keyring(store, clock, events, forget_default=state_dir.forget_api_key)
    keyring.bootstrap(state_dir.read_api_key(), state_dir.write_api_key)
    return keyring


def engine_adapters(session: WireEngineSession) -> dict[str, EngineAdapter]:
    """One adapter per engine family, each reaching its engines through ``session``."""
    return {
        "llamacpp": LlamaCppEngine(client=session),
        "vllm": VllmEngine(client=session),
        "sglang": SglangEngine(client=session),
        "tensorfold": TensorfoldEngine(client=session),
    }


def make_fleet(room: Switchboard, **parts: Any) -> Fleet:
    """The fleet, with the switchboard reading its managed controllers (and the hosts' devices, on a server of
    several machines)."""
    fleet = Fleet(room=room, **parts)
    room.bind(fleet.managed)
    hosts = parts.get("hosts")
    if hosts is not None:
        room.bind_hosts(hosts.devices)
    return fleet


def host_registry(
    store: SqliteStore, clock: SystemClock, events: Events, timings: Any, several: bool
) -> HostRegistry | None:
    """The server's hosts (``start server``); None for a CapyCTL that runs alone."""
    return HostRegistry(store, clock, events, timings) if several else None


def router_for(fleet: Fleet, clock: SystemClock, limits: QueueLimits) -> Router:
    """The one router both request services share: a sleeping instance's wake counts one instance's limit."""
    return Router(fleet, clock, limits.max_in_flight_per_instance)


def listening_stats(fleet: Fleet, admission: AdmissionService, events: Events, router: Router) -> RequestStats:
    """The Prometheus figures, counting parks, wakes and switches from the events."""
    stats = RequestStats(fleet, admission, router)
    events.listen(stats.event)
    return stats


def request_records(store: SqliteStore, clock: SystemClock, settings: RecordSettings, events: Events) -> RequestLog:
    """The request records, told by the events of each cut request that is settled."""
    records = RequestLog(store, clock, settings)
    events.on_settled(records.settle)
    return records


class Container(containers.DeclarativeContainer):
    config = providers.Configuration(strict=True)

    state_dir = providers.Singleton(StateDir, root=config.state_dir)
    clock = providers.Singleton(SystemClock)
    store = providers.Resource(open_store, state_dir=state_dir)
    events = providers.Singleton(Events, store=store, clock=clock, routine=routine_line)
    processes = providers.Singleton(PopenProcessControl)

    # the one client to engines: streams and decisions, and the adapters' probes, metrics, park and wake
    engine_session = providers.Singleton(WireEngineSession, max_event=config.max_event)
    adapters = providers.Singleton(engine_adapters, session=engine_session)

    controller_settings = providers.Singleton(ControllerSettings)
    request_settings = providers.Singleton(
        RequestSettings,
        request_deadline=config.request_deadline,
        stream_idle_timeout=config.stream_idle_timeout,
        max_tool_calls=config.max_tool_calls,
        default_model=config.default_model,
        host_name=providers.Callable(socket.gethostname),
    )

    admission = providers.Singleton(
        AdmissionService, limits=config.queue_limits, clock=clock, ready_timeout=config.request_deadline
    )
    switchboard = providers.Singleton(
        Switchboard,
        devices=config.devices,
        switching=config.switching,
        admission=admission,
        clock=clock,
        events=events,
        idle=config.idle,
    )
    canary = providers.Singleton(Canary, session=engine_session)
    hosts = providers.Singleton(
        host_registry, store=store, clock=clock, events=events, timings=config.hosts, several=config.several
    )
    fleet = providers.Singleton(
        make_fleet,
        room=switchboard,
        canary=canary,
        store=store,
        adapters=adapters,
        processes=processes,
        clock=clock,
        events=events,
        pick_port=providers.Object(free_port),
        log_root=providers.Callable(log_root, state_dir),
        settings=controller_settings,
        hosts=hosts,
    )
    keyring = providers.Singleton(open_keyring, store=store, clock=clock, events=events, state_dir=state_dir)
    router = providers.Singleton(router_for, fleet=fleet, clock=clock, limits=config.queue_limits)
    chat_service = providers.Singleton(
        ChatService,
        fleet=fleet,
        session=engine_session,
        clock=clock,
        events=events,
        settings=request_settings,
        admission=admission,
        keys=keyring,
        router=router,
    )
    request_stats = providers.Singleton(listening_stats, fleet=fleet, admission=admission, events=events, router=router)
    decision_service = providers.Singleton(
        DecisionService,
        fleet=fleet,
        session=engine_session,
        clock=clock,
        events=events,
        settings=request_settings,
        admission=admission,
        keys=keyring,
        router=router,
    )
    request_log = providers.Singleton(request_records, store=store, clock=clock, settings=config.records, events=events)
    chat_handler = providers.Singleton(
        FrontDoor,
        endpoints=providers.List(
            providers.Singleton(ChatEndpoint, service=chat_service, stats=request_stats),
            providers.Singleton(DecisionEndpoint, service=decision_service),
        ),
        keys=keyring,
        max_body=config.max_body,
        stats=request_stats,
        records=request_log,
    )


def open_ingress(state_dir: Path, header_timeout: float, body_timeout: float) -> Ingress:
    """The host's ingress, showing the certificate the host holds (a clear error where it has not joined)."""
    _, cert, key = HostIdentity.load(state_dir)
    return Ingress(cert, key, header_timeout=header_timeout, body_timeout=body_timeout)


def host_logs(state_dir: Path) -> Path:
    return state_dir / "logs"


class HostContainer(containers.DeclarativeContainer):
    """A host's object graph (``start host``): its engines, children of its agent on free loopback ports, behind
    its ingress; and what its agent does with the server's commands. The agent itself, which runs the link,
    is made by ``service.serve_host`` from these."""

    config = providers.Configuration(strict=True)

    clock = providers.Singleton(SystemClock)
    processes = providers.Singleton(PopenProcessControl)
    engine_session = providers.Singleton(WireEngineSession)
    adapters = providers.Singleton(engine_adapters, session=engine_session)
    ingress = providers.Singleton(
        open_ingress,
        state_dir=config.state_dir,
        header_timeout=config.header_timeout,
        body_timeout=config.body_timeout,
    )
    engines = providers.Singleton(
        HostEngines,
        adapters=adapters,
        processes=processes,
        clock=clock,
        pick_port=providers.Object(free_port),
        log_root=providers.Callable(host_logs, config.state_dir),
        gates=ingress,
    )
    commands = providers.Singleton(host_commands, ingress=ingress, engines=engines, adapters=adapters)


def build_host_container(state_dir: Path, header_timeout: float, body_timeout: float) -> HostContainer:
    container = HostContainer()
    container.config.from_dict({"state_dir": state_dir, "header_timeout": header_timeout, "body_timeout": body_timeout})
    return container
