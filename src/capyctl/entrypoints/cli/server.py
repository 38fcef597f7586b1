"""``capyctl start standalone``: the server in the foreground."""

from __future__ import annotations

from typing import Annotated

import anyio
import typer

from capyctl.adapters.storage.state_dir import resolve_state_dir
from capyctl.domain.deployments import parse_duration
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
) -> None:
    """Run CapyCTL and its engines in the foreground until Ctrl-C or SIGTERM."""
    if json:
        log_format = LogFormat.JSON
    deadline = parse_duration(request_deadline, "--request-deadline")
    idle = parse_duration(stream_idle_timeout, "--stream-idle-timeout")
    from capyctl.adapters.log_format import configure_logging
    from capyctl.entrypoints.service import serve_standalone

    listener = configure_logging(log_format.value)
    try:
        anyio.run(
            serve_standalone, resolve_state_dir(state_dir), listen, management, deadline, idle,
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
