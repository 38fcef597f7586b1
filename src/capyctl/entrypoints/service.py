"""``capyctl start standalone``: the server and its engines in one foreground process.

Two of CapyCTL's HTTP servers share one event loop: the inference API
(0.0.0.0:8443 by default) and the management API (127.0.0.1:7443). CapyCTL binds both sockets
itself first, so a busy port is a clear error before anything starts. SIGINT
or SIGTERM stops the servers, then every engine (SIGTERM, then SIGKILL after
the grace period), then exits.
"""

from __future__ import annotations

import gc
import logging
import resource
import signal
from pathlib import Path

import anyio
import msgspec

from capyctl import __version__
from capyctl.adapters.dashboard import with_dashboard
from capyctl.adapters.devices import read_devices
from capyctl.adapters.http.inference import create_inference_app
from capyctl.adapters.http.management import create_management_app
from capyctl.adapters.http.server import HttpServer
from capyctl.adapters.process.ports import listen_socket, parse_listen
from capyctl.adapters.storage.state_dir import CREDENTIALS, StateDir
from capyctl.domain.config import ServerConfig, Settings, resolve
from capyctl.domain.errors import InvalidConfig
from capyctl.domain.limits import HOST_MAX_BODY, Limits, across_hosts
from capyctl.entrypoints.container import Container
from capyctl.entrypoints.server_role import server_role

log = logging.getLogger("capyctl")
DEFAULTS = resolve(ServerConfig(), {})


def build_container(state_dir: Path, settings: Settings = DEFAULTS, several: bool = False) -> Container:
    container = Container()
    limits = settings.limits
    container.config.from_dict(
        {
            "state_dir": state_dir,
            "request_deadline": settings.request_deadline,
            "stream_idle_timeout": settings.stream_idle_timeout,
            "default_model": settings.default_model,
            "max_body": limits.max_body,
            "max_event": limits.max_event,
            "max_tool_calls": limits.max_tool_calls,
            "queue_limits": settings.queue,
            "devices": read_devices() if settings.devices == "auto" else settings.devices,
            "switching": settings.switching,
            "idle": settings.idle,
            "records": settings.records,
            "hosts": settings.hosts,
            "several": several,
        }
    )
    return container


async def serve_standalone(state_dir: Path, listen: str, management: str, settings: Settings = DEFAULTS) -> None:
    inference_addr = parse_listen(listen, "--listen")
    management_addr = parse_listen(management, "--management")
    raise_open_files_limit(settings.limits)
    container = build_container(state_dir, settings)
    container.init_resources()
    try:
        await _serve(container, inference_addr, management_addr, settings.limits)
    finally:
        container.shutdown_resources()


async def serve_server(
    state_dir: Path,
    listen: str,
    management: str,
    control_listen: str,
    control_advertise: str | None,
    settings: Settings = DEFAULTS,
) -> None:
    """``start standalone``, and the control listener where hosts join and link (several machines)."""
    inference_addr = parse_listen(listen, "--listen")
    management_addr = parse_listen(management, "--management")
    control_addr = parse_listen(control_listen, "--control-listen")
    if (state_dir / "identity" / "host.json").exists():  # one directory, one role
        raise InvalidConfig(
            f"{state_dir} holds a host's identity (identity/host.json): a server on this machine "
            "needs a state directory of its own (--state-dir DIR)"
        )
    advertised = control_advertise or (None if control_addr[0] in ("0.0.0.0", "::", "") else control_listen)
    if control_advertise is not None:
        parse_listen(control_advertise, "--control-advertise")
    if HOST_MAX_BODY < settings.limits.max_body != Limits().max_body:  # set so, not the default: said once
        log.warning(
            "limits.max_body is %d bytes, but a server of several machines takes at most %d bytes "
            "(what a host's ingress takes): larger bodies get 413 too_large",
            settings.limits.max_body,
            HOST_MAX_BODY,
        )
    settings = msgspec.structs.replace(settings, limits=across_hosts(settings.limits))
    raise_open_files_limit(settings.limits)
    container = build_container(state_dir, settings, several=True)
    container.init_resources()
    try:
        await _serve(container, inference_addr, management_addr, settings.limits, control=(control_addr, advertised))
    finally:
        container.shutdown_resources()


async def serve_host(state_dir: Path, settings: Settings = DEFAULTS, ingress_listen: str = "0.0.0.0:8444") -> None:
    """``start host``: the host agent keeps its link to the server, and its ingress serves, until SIGINT or
    SIGTERM."""
    from capyctl.adapters.control.host_agent import HostAgent, LinkRefused
    from capyctl.domain.link import DeviceReport, Inventory
    from capyctl.entrypoints.container import build_host_container

    ingress_addr = parse_listen(ingress_listen, "--ingress-listen")
    devices = read_devices() if settings.devices == "auto" else settings.devices  # read once, at start
    inventory = Inventory(
        devices=[DeviceReport(name=d.name, capacity=d.capacity, reserve=d.reserve) for d in devices], engines=[]
    )
    container = build_host_container(state_dir, settings.limits.header_timeout, settings.limits.body_timeout)
    ingress = container.ingress()  # whom it lets in, the server says over the link (``callers``)
    ingress_sock = listen_socket(*ingress_addr, "--ingress-listen")
    engines = container.engines()

    async def leaving() -> None:  # asked to stop while linked: the server hears each engine's end, and why
        await engines.stop_all(agent.tell)

    agent = HostAgent(
        state_dir,
        lambda: inventory,
        container.commands(),
        ingress_port=ingress_sock.getsockname()[1],
        running=engines.running,
        callers=ingress.trust_callers,
        leaving=leaving,
    )
    stopping = anyio.Event()
    log.info(
        "capyctl %s host %s: linking to the server at %s; ingress on %s:%s (HTTPS)",
        __version__,
        agent.name,
        agent.server,
        *ingress_sock.getsockname()[:2],
    )
    refused: LinkRefused | None = None
    async with anyio.create_task_group() as tg:
        tg.start_soon(_stop_on_signal, stopping)
        tg.start_soon(ingress.serve, ingress_sock, stopping)
        tg.start_soon(engines.watch, agent.tell)
        tg.start_soon(engines.report_loads, agent.tell)
        try:
            await agent.run(stopping)
        except LinkRefused as exc:  # raised after the task group, not inside it (which would wrap it)
            refused = exc
        finally:
            with anyio.CancelScope(shield=True):
                await engines.stop_all()  # what is left (the link was down): a host's engines end with its agent
        tg.cancel_scope.cancel()
    if refused is not None:
        raise refused
    log.info("capyctl host %s stopped", agent.name)


def raise_open_files_limit(limits: Limits) -> None:
    """Each relayed request holds two descriptors (client and engine): lift the soft limit to the hard one."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        soft = wanted
    if soft != resource.RLIM_INFINITY and soft < 2 * limits.max_connections + 256:
        log.warning(
            "open-files limit %d is below what --max-connections %d may need (%d); raise it with ulimit -n",
            soft,
            limits.max_connections,
            2 * limits.max_connections + 256,
        )


async def _serve(
    container: Container,
    inference_addr: tuple[str, int],
    management_addr: tuple[str, int],
    limits: Limits,
    control: tuple[tuple[str, int], str | None] | None = None,
) -> None:
    state: StateDir = container.state_dir()
    state.prepare()
    admin_token = state.admin_token()
    keys = container.keyring()
    fleet = container.fleet()
    stats = container.request_stats()
    door = container.chat_handler()
    inference = HttpServer(  # the door's own paths are its handlers; the rest goes to the ASGI app
        {path: door.serve for path in door.endpoints},
        create_inference_app(fleet, container.clock(), keys, stats, container.admission()),
        limits,
        stats.client_cut,
    )
    records = container.request_log()
    hosts = listener = None
    if control is not None:  # before the fleet runs: its deployments on hosts reach them through the session
        hosts, listener = server_role(state, container, *control)
    manager = HttpServer(
        {},
        create_management_app(fleet, container.clock(), admin_token, keys, records=records, hosts=hosts),
        limits,
        stats.client_cut,
    )
    stopping = anyio.Event()
    inference_sock = listen_socket(*inference_addr, "--listen")
    management_sock = listen_socket(*management_addr, "--management")
    control_sock = listen_socket(*control[0], "--control-listen") if control is not None else None
    management_url = "http://{}:{}".format(*management_sock.getsockname()[:2])
    manager.fallback = with_dashboard(  # the dashboard beside the management API, on its listener
        manager.fallback,
        fleet=fleet,
        admission=container.admission(),
        keys=keys,
        store=container.store(),
        events=container.events(),
        clock=container.clock(),
        admin_token=admin_token,
        log_root=state.root / "logs",
        listening=management_sock.getsockname()[:2],
        stopping=stopping,
        records=records,
        hosts=hosts,
    )
    # The signal watcher outlives the engines' shutdown, so a second Ctrl-C
    # cannot kill CapyCTL halfway through stopping them.
    async with anyio.create_task_group() as watcher:
        watcher.start_soon(_stop_on_signal, stopping)
        async with anyio.create_task_group() as tg:
            await tg.start(fleet.run)
            await tg.start(records.run)  # writes the request records off the requests' path
            if hosts is not None:
                await tg.start(hosts.registry.watch)
            state.write_management(management_url)
            host, port = inference_sock.getsockname()[:2]
            where = (
                f"the key named default in {state.root / CREDENTIALS}"
                if state.read_api_key()
                else "the key named default was revoked; see: capyctl list keys"
            )
            log.info(
                "capyctl %s serving http://%s:%s/v1 (%s); management %s", __version__, host, port, where, management_url
            )
            # What was made to start (modules, the apps, the fleet) lives as long as the server: out of the
            # collector's way, so that its passes over the young objects of requests stay short
            gc.collect()
            gc.freeze()
            async with anyio.create_task_group() as servers:
                servers.start_soon(inference.serve, inference_sock, stopping)
                servers.start_soon(manager.serve, management_sock, stopping)
                if listener is not None and control_sock is not None:
                    log.info("control: hosts join and link at %s:%s (TLS)", *control_sock.getsockname()[:2])
                    servers.start_soon(listener.serve, control_sock, stopping)
            state.clear_management()
            fleet.leave_hosts()
            tg.cancel_scope.cancel()  # fleet.run stops every engine on its way out (on this machine)
        watcher.cancel_scope.cancel()
    log.info("capyctl stopped; every engine is stopped")


async def _stop_on_signal(stopping: anyio.Event) -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            if not stopping.is_set():
                log.info("received %s: stopping servers and engines", signal.Signals(signum).name)
                stopping.set()
            else:
                log.info("received %s again: still stopping engines", signal.Signals(signum).name)
