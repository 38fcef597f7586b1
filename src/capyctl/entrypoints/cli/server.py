"""``capyctl start standalone``: the server in the foreground."""

from __future__ import annotations

from typing import Annotated

import anyio
import typer

from capyctl.adapters.storage.state_dir import resolve_state_dir
from capyctl.domain.deployments import parse_duration
from capyctl.domain.limits import Limits, parse_count, parse_size
from capyctl.entrypoints.cli.common import (
    LogFormat,
    StateDirOpt,
    reports_errors,
    start_app,
)


@start_app.command("standalone")
@reports_errors
def start_standalone(
    listen: Annotated[
        str, typer.Option(help="Inference API address. Use 127.0.0.1:8443 to keep it on this machine.")
    ] = "0.0.0.0:8443",
    management: Annotated[
        str, typer.Option(help="Management API address (the CLI's). Keep it on loopback.")
    ] = "127.0.0.1:7443",
    state_dir: StateDirOpt = None,
    log_format: Annotated[
        LogFormat, typer.Option(help="text: one line per event for people; json: one JSON object a line.")
    ] = LogFormat.TEXT,
    json: Annotated[bool, typer.Option("--json", help="Same as --log-format json.")] = False,
    request_deadline: Annotated[
        str, typer.Option(help="Longest wait for an answer to begin (starting the engine included), e.g. 300s, 30m.")
    ] = "30m",
    stream_idle_timeout: Annotated[
        str, typer.Option(help="Longest silence inside an answer before CapyCTL cuts it, e.g. 120s.")
    ] = "120s",
    max_body: Annotated[str, typer.Option(help="Largest request body (413 too_large past it), e.g. 32MiB.")] = "32MiB",
    client_header_timeout: Annotated[
        str, typer.Option(help="Time a client has to send its request headers (408 request_timeout), e.g. 10s.")
    ] = "10s",
    client_body_timeout: Annotated[
        str, typer.Option(help="Time a client has to send its body once its headers are in (408), e.g. 60s.")
    ] = "60s",
    max_connections: Annotated[
        str, typer.Option(help="Open client connections per API; past it, 503 too_many_connections.")
    ] = "4096",
    max_event_size: Annotated[
        str, typer.Option(help="Largest engine SSE event; past it the answer is cut as edge_error, e.g. 4MiB.")
    ] = "4MiB",
    max_tool_calls: Annotated[
        str, typer.Option(help="Most tool calls in one answer; an engine index past it is edge_error.")
    ] = "256",
) -> None:
    """Run CapyCTL and its engines in the foreground until Ctrl-C or SIGTERM.

    The limits (body size, client timeouts, connections, engine event size,
    tool calls) are listed with their defaults in docs/errors.md, "Limits".
    """
    if json:
        log_format = LogFormat.JSON
    deadline = parse_duration(request_deadline, "--request-deadline")
    idle = parse_duration(stream_idle_timeout, "--stream-idle-timeout")
    limits = Limits(
        max_body=parse_size(max_body, "--max-body"),
        header_timeout=parse_duration(client_header_timeout, "--client-header-timeout"),
        body_timeout=parse_duration(client_body_timeout, "--client-body-timeout"),
        max_connections=parse_count(max_connections, "--max-connections"),
        max_event=parse_size(max_event_size, "--max-event-size"),
        max_tool_calls=parse_count(max_tool_calls, "--max-tool-calls"),
    )
    from capyctl.adapters.log_format import configure_logging
    from capyctl.entrypoints.service import serve_standalone

    listener = configure_logging(log_format.value)
    try:
        anyio.run(
            serve_standalone, resolve_state_dir(state_dir), listen, management, deadline, idle, limits,
            backend_options={"use_uvloop": _has_uvloop()},
        )
    finally:
        listener.stop()  # flushes the last lines


def _has_uvloop() -> bool:
    """uvloop (installed with uvicorn[standard]) makes the relay's sockets markedly cheaper; asyncio otherwise."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True
