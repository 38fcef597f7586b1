"""What every ``capyctl`` command shares: the Typer apps, common options, error reporting."""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any, ParamSpec, TypeVar

import typer

from capyctl.adapters.storage.state_dir import resolve_state_dir
from capyctl.domain.errors import CapyError
from capyctl.entrypoints.cli.output import exit_code, print_error, print_json

if TYPE_CHECKING:
    from capyctl.entrypoints.cli.client import ManagementClient

P = ParamSpec("P")
R = TypeVar("R")


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
TimeoutOpt = Annotated[float, typer.Option(help="Seconds --wait waits before giving up.")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON instead of a table.")]


def _typer(help: str, **options: Any) -> typer.Typer:
    """A command group. Help is click's plain layout: Typer's rich one shows every flag (--version, --json,
    --help) as taking a `<bool>`, which they do not."""
    return typer.Typer(help=help, no_args_is_help=True, rich_markup_mode=None, **options)


app = _typer(
    "CapyCTL: one authenticated OpenAI-compatible endpoint in front of your LLM engines.\n\n"
    "Start the server with `capyctl start standalone`, register an engine with `capyctl engine add`, "
    "then `capyctl deploy model --file model.yaml --activate --wait`. With several machines: `capyctl start "
    "server`, then `capyctl invite host NAME` for each GPU machine (docs/several-machines.md).",
    add_completion=False,
    pretty_exceptions_enable=False,
)
start_app = _typer("Start the server (standalone, or the server of several machines), a host's agent, or a deployment.")
stop_app = _typer("Stop a deployment (sticky: requests will not restart it).")
park_app = _typer(
    "Park a deployment: its engine sleeps (or stops, for restart_only) until a request "
    "or `capyctl start deployment` wakes it."
)
delete_app = _typer("Delete a deployment (stops its engine first).")
status_app = _typer("Show a deployment's state and instances.")
list_app = _typer("List deployments, engines, devices, API keys, request records or hosts.")
create_app = _typer("Create a named API key.")
revoke_app = _typer("Revoke a named API key (its next request is refused) or a host (its link closes).")
invite_app = _typer("Invite a GPU machine to join this server as a host.")
join_app = _typer("Join this machine to a server, with the file `capyctl invite host` wrote.")
drain_app = _typer("Drain a host: nothing new is placed there; its instances move elsewhere and stop.")
undrain_app = _typer("Undrain a host: it takes instances again.")
engine_app = _typer("Register, list and remove engine installations.")
deploy_app = _typer("Create or update deployments from files.")
config_app = _typer("The server configuration file: its schema, and checking a file.")
for name, sub in [
    ("start", start_app),
    ("stop", stop_app),
    ("park", park_app),
    ("delete", delete_app),
    ("status", status_app),
    ("list", list_app),
    ("engine", engine_app),
    ("deploy", deploy_app),
    ("config", config_app),
    ("create", create_app),
    ("revoke", revoke_app),
    ("invite", invite_app),
    ("join", join_app),
    ("drain", drain_app),
    ("undrain", undrain_app),
]:
    app.add_typer(sub, name=name)


def reports_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn CapyCTL errors into `error [code]: message` on stderr and a documented exit code."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except CapyError as error:
            if kwargs.get("json") is True:  # --json: the failure is JSON too, on stdout, same exit code
                print_json({"error": {"code": error.code, "message": error.message, **error.extra}})
            print_error(error.code, error.message)
            raise typer.Exit(exit_code(error.code)) from None

    return wrapper


def client(state_dir: str | None) -> ManagementClient:
    from capyctl.entrypoints.cli.client import ManagementClient  # http.client: for the commands that call the server

    return ManagementClient(resolve_state_dir(state_dir))


def _version(value: bool) -> None:
    if value:
        from capyctl import __version__

        typer.echo(f"capyctl {__version__}")
        raise typer.Exit()


@app.callback()
def main_options(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """CapyCTL command line."""
