"""The host's role in several machines, composed: what its agent does with the server's commands, and its
engines (children of the agent, on free loopback ports, behind its ingress)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec

from capyctl.adapters.clock import SystemClock
from capyctl.adapters.control.host_ingress import Ingress
from capyctl.adapters.engines._wire import WireEngineSession
from capyctl.adapters.engines.llamacpp import LlamaCppEngine
from capyctl.adapters.engines.sglang import SglangEngine
from capyctl.adapters.engines.tensorfold import TensorfoldEngine
from capyctl.adapters.engines.vllm import VllmEngine
from capyctl.adapters.process.children import PopenProcessControl
from capyctl.adapters.process.ports import free_port
from capyctl.domain.errors import InvalidRequest
from capyctl.domain.link import Command, CommandResult
from capyctl.domain.ports import EngineAdapter
from capyctl.services.fleet import inspect_install
from capyctl.services.host_engines import HostEngines


def host_commands(
    ingress: Ingress, engines: HostEngines | None = None
) -> Callable[[Command], Awaitable[CommandResult]]:
    """What a host agent does with the server's commands: run its engines (``engines``), inspect an engine
    installation, open and close the ingress's gates."""
    session = WireEngineSession()
    adapters = engine_adapters(session)

    async def handle(command: Command) -> CommandResult:
        args = command.args
        detail = await engines.handle(command) if engines is not None else None  # None: not an engine command
        if detail is not None:
            return CommandResult(id=command.id, generation=command.generation, ok=True, detail=detail)
        if command.action == "inspect_engine":
            install = await inspect_install(adapters, str(args.get("path") or ""), args.get("name"), args.get("family"))
            detail = msgspec.to_builtins(install)
        elif command.action == "open_gate":
            key, port = args.get("key"), args.get("port")
            if not isinstance(key, str) or not isinstance(port, int):
                raise InvalidRequest("open_gate takes a key (text) and the engine's port (a number)")
            ingress.open_gate(key, port)
        elif command.action == "close_gate":
            ingress.close_gate(str(args.get("key") or ""))
        else:
            raise InvalidRequest(f"this host does not run {command.action!r} commands yet")
        return CommandResult(id=command.id, generation=command.generation, ok=True, detail=detail or {})

    return handle


def engine_adapters(session: WireEngineSession) -> dict[str, EngineAdapter]:
    return {
        "llamacpp": LlamaCppEngine(client=session),
        "vllm": VllmEngine(client=session),
        "sglang": SglangEngine(client=session),
        "tensorfold": TensorfoldEngine(client=session),
    }


def host_engines(ingress: Ingress, log_root: Path) -> HostEngines:
    """The host's engines as children of its agent, on free loopback ports, behind its ingress."""
    return HostEngines(
        engine_adapters(WireEngineSession()), PopenProcessControl(), SystemClock(), free_port, log_root, ingress
    )
