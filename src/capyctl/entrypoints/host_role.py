"""The host's role in several machines: what its agent does with the server's commands (its engines, engine
installations, the ingress's gates). Its parts are composed by ``container.HostContainer``."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping

import msgspec

from capyctl.adapters.control.host_ingress import Ingress
from capyctl.domain.errors import InvalidRequest
from capyctl.domain.link import Command, CommandResult
from capyctl.domain.ports import EngineAdapter
from capyctl.services.fleet import inspect_install
from capyctl.services.host_engines import HostEngines


def host_commands(
    ingress: Ingress, engines: HostEngines | None, adapters: Mapping[str, EngineAdapter]
) -> Callable[[Command], Awaitable[CommandResult]]:
    """What a host agent does with the server's commands: run its engines (``engines``), inspect an engine
    installation (with ``adapters``), open and close the ingress's gates."""

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
