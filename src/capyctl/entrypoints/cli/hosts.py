"""Several machines: ``start server``, ``invite host``, ``join host``, ``start host``, ``list hosts``,
``drain host``, ``undrain host``, ``revoke host``."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Any

import msgspec
import typer

from capyctl.adapters.storage.state_dir import resolve_state_dir
from capyctl.domain.errors import InvalidConfig
from capyctl.entrypoints.cli.common import (
    JsonOpt,
    StateDirOpt,
    TimeoutOpt,
    client,
    drain_app,
    invite_app,
    join_app,
    list_app,
    reports_errors,
    revoke_app,
    start_app,
    undrain_app,
)
from capyctl.entrypoints.cli.deployments import WaitTimeout, gib
from capyctl.entrypoints.cli.output import duration, show, stamp, table


@invite_app.command("host")
@reports_errors
def invite_host(
    name: Annotated[str, typer.Argument(help="The host's name: 1-63 of a-z, 0-9 and '-' (not first or last).")],
    ttl: Annotated[str, typer.Option(help="How long the invitation may be used: at most 1h.")] = "15m",
    output: Annotated[
        Path | None, typer.Option(help="Where to write the join file (0600). Default: ./NAME.join.", show_default=False)
    ] = None,
    server: Annotated[
        str | None,
        typer.Option(
            help="The server's control address as the host reaches it (ADDR:PORT). "
            "Default: the address given to --control-listen, or --control-advertise.",
            show_default=False,
        ),
    ] = None,
    state_dir: StateDirOpt = None,
    json: JsonOpt = False,
) -> None:
    """Write a join file for one GPU machine: copy it there and run `capyctl join host --join-file FILE`.

    The file holds a secret that works once, for this host name only, until the TTL ends; the server keeps
    only its hash. It also pins the server's CA, so the host talks only to this server.
    """
    from capyctl.adapters.pki import write_private  # cryptography
    from capyctl.domain.deployments import parse_duration

    seconds = parse_duration(ttl, "--ttl")
    join = client(state_dir).call("POST", "/hosts/invites", json={"name": name, "ttl_s": seconds, "server": server})
    path = output if output is not None else Path(f"{name}.join")
    write_private(path, msgspec.json.encode(join) + b"\n")
    view = {"host": name, "join_file": str(path), "server": join["server"], "expires_at": join["expires_at"]}
    show(
        view,
        json,
        f"invitation for host {name} written to {path} (0600); it works once, until "
        f"{stamp(join['expires_at'])}\n  on {name}: capyctl join host --join-file {path.name}",
    )


@join_app.command("host")
@reports_errors
def join_host(
    join_file: Annotated[Path, typer.Option("--join-file", help="The file `capyctl invite host` wrote.")],
    state_dir: StateDirOpt = None,
    json: JsonOpt = False,
) -> None:
    """Join this machine to the server of a join file, as the host named in it (run on the GPU machine)."""
    import anyio

    from capyctl.adapters.control.host_agent import join
    from capyctl.domain.joining import JoinFile

    try:
        data = join_file.read_bytes()
    except OSError as exc:
        raise InvalidConfig(f"cannot read the join file {join_file}: {exc.strerror}") from exc
    try:
        parsed = msgspec.json.decode(data, type=JoinFile)
    except msgspec.ValidationError as exc:
        raise InvalidConfig(f"{join_file} is not a CapyCTL join file: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise InvalidConfig(f"{join_file} is not a CapyCTL join file (not JSON): {exc}") from exc
    root = resolve_state_dir(state_dir)
    held = next(
        (p for p in ("identity/ca", "identity/server-credentials.json", "identity/credentials") if (root / p).exists()),
        None,
    )
    if held is not None:  # one directory, one role: a host's identity beside a server's would confuse both
        raise InvalidConfig(
            f"{root} is the state directory of a CapyCTL server or standalone ({root / held} is "
            "there); a host needs a directory of its own: capyctl join host --join-file "
            f"{join_file} --state-dir DIR, then capyctl start host --state-dir DIR"
        )
    identity = anyio.run(join, parsed, root)
    show(
        {"host": identity.name, "server": identity.server, "fingerprint": identity.fingerprint},
        json,
        f"joined the server at {identity.server} as host {identity.name}\n"
        f"  next: capyctl start host{'' if state_dir is None else ' --state-dir ' + str(root)}",
    )


@start_app.command("host")
@reports_errors
def start_host(
    state_dir: StateDirOpt = None,
    ingress_listen: Annotated[
        str,
        typer.Option(
            help="Where the host's ingress listens (HTTPS with its certificate): the server reaches this machine's "
            "engines there, and only there."
        ),
    ] = "0.0.0.0:8444",
    config: Annotated[
        Path | None,
        typer.Option(
            help="The host's configuration file: its `memory.devices` (declared, or auto) are what it reports. "
            "Default: <state-dir>/config.yaml when it exists; else no devices.",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Run this machine's host agent in the foreground: it keeps the link to the server up.

    It dials the server named in its join file with the certificate it got when it joined, and dials
    again (backing off up to 10 s) whenever the link drops. It exits when the server says the host is
    revoked.
    """
    import anyio

    from capyctl.adapters.log_format import configure_logging
    from capyctl.entrypoints.cli.server import load_settings
    from capyctl.entrypoints.service import serve_host

    root = resolve_state_dir(state_dir)
    settings = load_settings(root, config, {})
    writer = configure_logging("text")
    try:
        anyio.run(serve_host, root, settings, ingress_listen)
    finally:
        writer.stop()


@list_app.command("hosts")
@reports_errors
def list_hosts(state_dir: StateDirOpt = None, json: JsonOpt = False) -> None:
    """The hosts that joined this server: state, address, last heartbeat, version, devices (what is charged on
    each, of its capacity), engines, instances."""
    hosts: list[dict[str, Any]] = client(state_dir).call("GET", "/hosts")
    rows = [
        [
            h["name"],
            h["state"] + (f", {h['drain']}" if h.get("drain") else ""),
            h["address"],
            None if h["silent_s"] is None else f"{duration(h['silent_s']) or '0s'} ago",
            h["version"],
            ", ".join(
                f"{d['name']} {gib(d.get('charged_bytes', 0))} of {gib(d['capacity_bytes'])}" for d in h["devices"]
            )
            or None,
            ",".join(e["name"] for e in h["engines"]) or None,
            len(h["instances"]),
        ]
        for h in hosts
    ]
    show(
        hosts,
        json,
        table(["NAME", "STATE", "ADDRESS", "HEARD", "VERSION", "DEVICES", "ENGINES", "INSTANCES"], rows)
        if hosts
        else "no hosts; invite one with: capyctl invite host NAME",
    )


@revoke_app.command("host")
@reports_errors
def revoke_host(
    name: Annotated[str, typer.Argument(help="The host's name (see: capyctl list hosts).")],
    state_dir: StateDirOpt = None,
    json: JsonOpt = False,
) -> None:
    """Revoke a host for good: its link closes now; its certificate and join file are refused from now on."""
    revoked = client(state_dir).call("DELETE", f"/hosts/{name}")
    show(revoked, json, f"host {name} revoked")


@drain_app.command("host")
@reports_errors
def drain_host(
    name: Annotated[str, typer.Argument(help="The host's name (see: capyctl list hosts).")],
    wait: Annotated[bool, typer.Option(help="Wait until no instance runs there any more.")] = False,
    timeout: TimeoutOpt = 600.0,
    state_dir: StateDirOpt = None,
    json: JsonOpt = False,
) -> None:
    """Drain a host: nothing new is placed on it; each of its instances gets a replacement where room exists,
    takes no new request, finishes those under way (within switching.drain_timeout) and stops. `list hosts`
    shows it draining, then drained; `undrain host` takes it back."""
    api = client(state_dir)
    view = api.call("POST", f"/hosts/{name}/drain")
    if wait:
        began = time.monotonic()
        while view["drain"] != "drained":
            if time.monotonic() - began > timeout:
                raise WaitTimeout(
                    f"host {name} still runs {', '.join(view['instances']) or 'instances'} after {timeout:.0f} s"
                )
            time.sleep(0.25)
            view = api.call("GET", f"/hosts/{name}")
    show(view, json, f"host {name} {view['drain']}" + ("" if view["drain"] == "drained" else _moving(view)))


def _moving(view: dict[str, Any]) -> str:
    running = view["instances"]
    return f": {', '.join(running)} still running there" if running else ""


@undrain_app.command("host")
@reports_errors
def undrain_host(
    name: Annotated[str, typer.Argument(help="The host's name (see: capyctl list hosts).")],
    state_dir: StateDirOpt = None,
    json: JsonOpt = False,
) -> None:
    """Undrain a host: instances may be placed on it again (those without a place are placed at once)."""
    view = client(state_dir).call("POST", f"/hosts/{name}/undrain")
    show(view, json, f"host {name} undrained")
