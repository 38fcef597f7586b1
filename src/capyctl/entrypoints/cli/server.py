"""``capyctl start standalone`` (the server in the foreground) and ``capyctl config`` (its file)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from capyctl.adapters.storage.state_dir import resolve_state_dir
from capyctl.domain.errors import InvalidConfig
from capyctl.entrypoints.cli.common import (
    JsonOpt,
    LogFormat,
    StateDirOpt,
    config_app,
    reports_errors,
    start_app,
)
from capyctl.entrypoints.cli.output import print_json, show

if TYPE_CHECKING:
    from capyctl.domain.config import ServerConfig, Settings

ListenOpt = Annotated[str, typer.Option(help="Inference API address. Use 127.0.0.1:8443 to keep it on this machine.")]
ManagementOpt = Annotated[str, typer.Option(help="Management API address (the CLI's). Keep it on loopback.")]
LogFormatOpt = Annotated[
    LogFormat, typer.Option(help="text: one line per event for people; json: one JSON object a line.")
]
JsonLogOpt = Annotated[bool, typer.Option("--json", help="Same as --log-format json.")]


def load_settings(root: Path, config: Path | None, overrides: dict[str, Any]) -> Settings:
    """The settings of ``config`` (default: <state-dir>/config.yaml when it exists; else the defaults), with the
    command line's ``overrides`` on top."""
    from capyctl.adapters.config_files import decode_file  # YAML
    from capyctl.domain.config import ServerConfig

    file = config if config is not None else (root / "config.yaml" if (root / "config.yaml").exists() else None)
    return _resolve(file, decode_file(file, ServerConfig) if file is not None else ServerConfig(), overrides)


@start_app.command("standalone")
@reports_errors
def start_standalone(
    listen: ListenOpt = "0.0.0.0:8443",
    management: ManagementOpt = "127.0.0.1:7443",
    state_dir: StateDirOpt = None,
    config: Annotated[
        Path | None,
        typer.Option(
            help="Server configuration file (see `capyctl config schema`). "
            "Default: <state-dir>/config.yaml when it exists. Flags given here win over it.",
            show_default=False,
        ),
    ] = None,
    log_format: LogFormatOpt = LogFormat.TEXT,
    json: JsonLogOpt = False,
    default_model: Annotated[
        str | None,
        typer.Option(
            help="Deployment a chat request without `model` goes to [file: default_model].", show_default=False
        ),
    ] = None,
    request_deadline: Annotated[
        str | None,
        typer.Option(
            help="Longest wait for an answer to begin (starting the engine included), "
            "e.g. 300s [file: queue.request_deadline; default 30m].",
            show_default=False,
        ),
    ] = None,
    stream_idle_timeout: Annotated[
        str | None,
        typer.Option(
            help="Longest silence inside an answer before CapyCTL cuts it "
            "[file: queue.stream_idle_timeout; default 120s].",
            show_default=False,
        ),
    ] = None,
    max_body: Annotated[
        str | None,
        typer.Option(
            help="Largest request body, 413 too_large past it [file: limits.max_body; default 32MiB].",
            show_default=False,
        ),
    ] = None,
    client_header_timeout: Annotated[
        str | None,
        typer.Option(
            help="Time a client has to send its request headers, 408 past it "
            "[file: limits.client_header_timeout; default 10s].",
            show_default=False,
        ),
    ] = None,
    client_body_timeout: Annotated[
        str | None,
        typer.Option(
            help="Time a client has to send its body once its headers are in, 408 past it "
            "[file: limits.client_body_timeout; default 60s].",
            show_default=False,
        ),
    ] = None,
    max_connections: Annotated[
        str | None,
        typer.Option(
            help="Open client connections per API, 503 too_many_connections past it "
            "[file: limits.max_connections; default 4096].",
            show_default=False,
        ),
    ] = None,
    max_event_size: Annotated[
        str | None,
        typer.Option(
            help="Largest engine SSE event, edge_error past it [file: limits.max_event_size; default 4MiB].",
            show_default=False,
        ),
    ] = None,
    max_tool_calls: Annotated[
        str | None,
        typer.Option(
            help="Most tool calls in one answer, edge_error past it [file: limits.max_tool_calls; default 256].",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Run CapyCTL and its engines in the foreground until Ctrl-C or SIGTERM.

    Settings come from the configuration file, then from the flags given here,
    which win. The limits are listed in docs/errors.md, "Limits".
    """
    import anyio

    from capyctl.domain.deployments import parse_duration
    from capyctl.domain.limits import parse_count, parse_size

    if json:
        log_format = LogFormat.JSON
    root = resolve_state_dir(state_dir)
    overrides = {
        "default_model": default_model,
        "queue.request_deadline": _flag(request_deadline, "--request-deadline", parse_duration),
        "queue.stream_idle_timeout": _flag(stream_idle_timeout, "--stream-idle-timeout", parse_duration),
        "limits.max_body": _flag(max_body, "--max-body", parse_size),
        "limits.client_header_timeout": _flag(client_header_timeout, "--client-header-timeout", parse_duration),
        "limits.client_body_timeout": _flag(client_body_timeout, "--client-body-timeout", parse_duration),
        "limits.max_connections": _flag(max_connections, "--max-connections", parse_count),
        "limits.max_event_size": _flag(max_event_size, "--max-event-size", parse_size),
        "limits.max_tool_calls": _flag(max_tool_calls, "--max-tool-calls", parse_count),
    }
    settings = load_settings(root, config, overrides)
    from capyctl.adapters.log_format import configure_logging
    from capyctl.entrypoints.service import serve_standalone

    writer = configure_logging(log_format.value)
    try:
        anyio.run(
            serve_standalone,
            root,
            listen,
            management,
            settings,
            backend_options={"use_uvloop": _has_uvloop()},
        )
    finally:
        writer.stop()  # writes the last lines


@start_app.command("server")
@reports_errors
def start_server(
    listen: ListenOpt = "0.0.0.0:8443",
    management: ManagementOpt = "127.0.0.1:7443",
    control_listen: Annotated[
        str, typer.Option(help="Where hosts join and keep their control link (TLS, the server's own CA).")
    ] = "0.0.0.0:7445",
    control_advertise: Annotated[
        str | None,
        typer.Option(
            help="The control address join files name, as hosts reach it (ADDR:PORT). "
            "Default: --control-listen, which must then name an address.",
            show_default=False,
        ),
    ] = None,
    state_dir: StateDirOpt = None,
    config: Annotated[
        Path | None,
        typer.Option(
            help="Server configuration file (see `capyctl config schema`). "
            "Default: <state-dir>/config.yaml when it exists.",
            show_default=False,
        ),
    ] = None,
    log_format: LogFormatOpt = LogFormat.TEXT,
    json: JsonLogOpt = False,
) -> None:
    """Run the server of several machines in the foreground until Ctrl-C or SIGTERM.

    It serves the inference and management APIs as `start standalone` does, and listens for hosts:
    `capyctl invite host NAME` writes a join file for a GPU machine. At its first start it makes its
    CA and writes identity/server-credentials.json (the API key, 0600).
    """
    import anyio

    if json:
        log_format = LogFormat.JSON
    root = resolve_state_dir(state_dir)
    settings = load_settings(root, config, {})
    from capyctl.adapters.log_format import configure_logging
    from capyctl.entrypoints.service import serve_server

    writer = configure_logging(log_format.value)
    try:
        anyio.run(
            serve_server,
            root,
            listen,
            management,
            control_listen,
            control_advertise,
            settings,
            backend_options={"use_uvloop": _has_uvloop()},
        )
    finally:
        writer.stop()


def _flag(value: str | None, what: str, parse: Callable[[str, str], Any]) -> Any:
    return None if value is None else parse(value, what)


def _resolve(file: Path | None, config: ServerConfig, overrides: dict[str, Any]) -> Settings:
    """``resolve``, whose refusals name the file like the decoder's do (flags were checked before)."""
    from capyctl.domain.config import resolve

    try:
        return resolve(config, overrides)
    except InvalidConfig as exc:
        raise InvalidConfig(exc.message if file is None else f"{file}: {exc.message}") from exc


@config_app.command("schema")
@reports_errors
def config_schema() -> None:
    """Print the JSON Schema of the server configuration file (for editors' YAML support)."""
    from capyctl.domain.config import schema

    print_json(schema())


@config_app.command("check")
@reports_errors
def config_check(
    file: Annotated[Path, typer.Argument(help="The configuration file to check.")],
    json: JsonOpt = False,
) -> None:
    """Check a server configuration file and show the settings it gives; changes nothing."""
    from capyctl.adapters.config_files import decode_file  # YAML
    from capyctl.domain.config import ServerConfig

    settings = _resolve(file, decode_file(file, ServerConfig), {})
    limits = settings.limits
    devices = (
        settings.devices
        if settings.devices == "auto"
        else [{"name": d.name, "capacity_bytes": d.capacity, "reserve_bytes": d.reserve} for d in settings.devices]
    )
    view: dict[str, Any] = {
        "default_model": settings.default_model,
        "queue": {
            "request_deadline_s": settings.request_deadline,
            "stream_idle_timeout_s": settings.stream_idle_timeout,
        },
        "limits": {
            "max_body_bytes": limits.max_body,
            "client_header_timeout_s": limits.header_timeout,
            "client_body_timeout_s": limits.body_timeout,
            "max_connections": limits.max_connections,
            "max_event_size_bytes": limits.max_event,
            "max_tool_calls": limits.max_tool_calls,
        },
        "memory": {"devices": devices},
        "records": {
            "max_count": settings.records.retention.max_count,
            "max_age_s": settings.records.retention.max_age,
            "buffer": settings.records.buffer,
        },
    }
    lines = [f"{file}: valid", f"  default_model  {settings.default_model or '-'}"]
    for section in ("queue", "limits", "records"):
        lines += [f"  {section}.{key}  {value}" for key, value in view[section].items()]
    lines += (
        ["  memory.devices  auto"]
        if devices == "auto"
        else [
            f"  memory.devices.{d['name']}  capacity_bytes {d['capacity_bytes']}  reserve_bytes {d['reserve_bytes']}"
            for d in devices
        ]
        or ["  memory.devices  -"]
    )
    show(view, json, "\n".join(lines))


def _has_uvloop() -> bool:
    """uvloop (installed with uvicorn[standard]) makes the relay's sockets markedly cheaper; asyncio otherwise."""
    try:
        import uvloop  # noqa: F401 - imported only to learn that it is installed
    except ImportError:
        return False
    return True
