"""Deployments: deploy, list, status, start, stop, delete, and the event log."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import msgspec
import typer

from capyctl.domain.errors import CapyError
from capyctl.entrypoints.cli.common import (
    JsonOpt,
    StateDirOpt,
    TimeoutOpt,
    app,
    client,
    delete_app,
    deploy_app,
    list_app,
    park_app,
    reports_errors,
    start_app,
    status_app,
    stop_app,
)
from capyctl.entrypoints.cli.output import duration, print_json, show, stamp, table

if TYPE_CHECKING:
    from capyctl.entrypoints.cli.client import ManagementClient


@deploy_app.command("model")
@reports_errors
def deploy_model(
    file: Annotated[Path, typer.Option("--file", "-f", help="Deployment YAML: name, engine, model, ...")],
    activate: Annotated[bool, typer.Option(help="Start the engine now instead of on the first request.")] = False,
    wait: Annotated[bool, typer.Option(help="Start it and wait until it is ready (implies --activate).")] = False,
    timeout: TimeoutOpt = 600.0,
    state_dir: StateDirOpt = None,
    json: JsonOpt = False,
) -> None:
    """Create or update a deployment from a YAML file."""
    from capyctl.adapters.config_files import decode_file, load_yaml_file  # YAML
    from capyctl.domain.deployments import DeploymentSpec
    from capyctl.entrypoints.cli.client import ServerError

    document = load_yaml_file(file)
    decode_file(file, DeploymentSpec)  # refused here with the line of the bad key; the server checks the rest
    api = client(state_dir)
    try:
        result = api.call("PUT", "/deployments", json={"document": document, "activate": activate or wait})
    except ServerError as error:
        if error.code != "invalid_config":
            raise
        # what the server refuses in the file is named with the file, as what is refused above is
        raise ServerError(error.code, f"{file}: {error.message}", error.extra) from None
    deployment = result["deployment"]
    if not json:
        typer.echo(f"deployment {deployment['name']} {result['outcome']}")
    if wait:
        deployment = _wait_ready(api, deployment["name"], timeout, quiet=json)
    if json:
        print_json({**result, "deployment": deployment})


def _wait_ready(api: ManagementClient, name: str, timeout: float, quiet: bool) -> dict[str, Any]:
    """Poll the deployment until every placed instance is ready, printing each change on stderr (and why an
    instance has no place, when one has none)."""
    started = time.monotonic()
    last = None
    while True:
        deployment: dict[str, Any] = api.call("GET", f"/deployments/{name}")
        instances = deployment["instances"]
        states = [i["state"] for i in instances]
        shown = _progress(deployment)
        if shown != last and not quiet:
            sys.stderr.write(f"  {name}: {shown}\n")
            last = shown
        if instances and all(state == "ready" for state in states):
            if deployment["unplaced"] and not quiet:
                sys.stderr.write("".join(f"  {name}: {reason}\n" for reason in deployment["unplaced"]))
            return deployment
        waited = time.monotonic() - started
        for instance in instances:
            where = f"deployment {name}" + (f" instance {instance['index']}" if len(instances) > 1 else "")
            if instance["state"] in ("failed", "stopped"):
                raise DeploymentFailed(
                    f"{where} is {instance['state']}: {instance['last_error']}; engine log: {instance['log']}"
                )
            if instance["state"] == "unavailable" and waited > ATTACHED_PATIENCE:
                raise DeploymentFailed(f"{where}: {instance['last_error']}")
        if waited > timeout:
            why = "; ".join(deployment["unplaced"]) or "; ".join(f"log: {i['log']}" for i in instances if i["log"])
            raise WaitTimeout(f"deployment {name} not ready after {timeout:.0f} s ({shown}); {why}")
        time.sleep(0.25)


def _progress(deployment: dict[str, Any]) -> str:
    """The state to show while waiting: the deployment's, or how many of its instances are ready."""
    instances = deployment["instances"]
    if not instances:
        return "no instance placed yet"
    if len(instances) == 1 and deployment["instances_wanted"] == 1:
        return str(instances[0]["state"])
    ready = sum(1 for i in instances if i["state"] == "ready")
    return f"{ready} of {deployment['instances_wanted']} instances ready"


ATTACHED_PATIENCE = 12.0  # an attached engine is checked for 10 s by the server


class DeploymentFailed(CapyError):
    code = "deployment_failed"


class WaitTimeout(CapyError):
    code = "timeout"


def _deployment_rows(deployments: list[dict[str, Any]]) -> str:
    rows = [
        [
            d["name"],
            d["api"],
            _state(d) + (" (operator)" if d["operator_stopped"] else ""),
            _hosts(d),
            f"{d['engine']} {d['engine_version']}",
            d["model"],
        ]
        for d in deployments
    ]
    return table(["NAME", "API", "STATE", "HOST", "ENGINE", "MODEL"], rows)


def _state(d: dict[str, Any]) -> str:
    """The deployment's state, or ``held`` while the host its engine runs on is out of reach."""
    held = [i for i in d["instances"] if i.get("held")]
    if held and len(held) == len(d["instances"]):
        return f"held ({held[0]['held']['reason']})"
    wanted = d.get("instances_wanted", 1)
    if wanted == 1 and len(d["instances"]) == 1:
        return str(d["state"])
    ready = sum(1 for i in d["instances"] if i["state"] == "ready")
    return f"{d['state']} ({ready}/{wanted} ready)"


def _hosts(d: dict[str, Any]) -> str:
    """Where its instances run: each host once, ``this machine`` for the server's own; ``-`` with none."""
    seen = list(dict.fromkeys(i["host"] or "this machine" for i in d["instances"]))
    if not seen:
        return d["host"] or "-"
    return ",".join(seen) if seen != ["this machine"] else "-"


@list_app.command("deployments")
@reports_errors
def list_deployments(state_dir: StateDirOpt = None, json: JsonOpt = False) -> None:
    """List deployments and their states."""
    deployments = client(state_dir).call("GET", "/deployments")
    show(deployments, json, _deployment_rows(deployments))


def _memory_line(memory: dict[str, Any]) -> str:
    if memory["device"] is None:
        declared = f"declares {gib(memory['memory_bytes'])}; " if memory["memory_bytes"] else ""
        return f"memory      {declared}not accounted (no device)"
    line = (
        f"memory      {gib(memory['charged_bytes'])} charged on {memory['device']} "
        f"({memory['holding']}; declares {gib(memory['memory_bytes'])} awake, "
        f"{gib(memory['parked_memory_bytes'] or 0)} parked)"
    )
    switch = memory.get("last_switch")
    if switch:
        victims = ", ".join(f"{v['name']} {v['action']}" for v in switch["victims"]) or "none"
        line += f"\nswitch      last on {memory['device']}: for {switch['target']}, {victims}: {switch['outcome']}"
    return line


_DESIRED = {
    "run": "keep an engine serving",
    "on_demand": "the first request starts it",
    "stop": "an operator's stop: only `capyctl start deployment` starts it",
    "park": "keep it parked: the next request wakes it",
}


def _status_text(d: dict[str, Any]) -> str:
    instances = d["instances"]
    hosts = _hosts(d)
    head = [
        f"deployment  {d['name']}",
        f"state       {_state(d)}" + ("  (stopped by an operator)" if d["operator_stopped"] else ""),
        *[f"held        {i['held']['message']}" for i in instances if i.get("held")],
        f"host        {hosts} (its engine runs there, reached through its ingress)"
        if hosts != "-" and len(instances) <= 1
        else f"hosts       {hosts} (each instance's is in the table below)"
        if hosts != "-"
        else "host        this machine",
        *(
            [f"instances   {len(instances)} placed of {d['instances_wanted']} ({_placement_text(d['placement'])})"]
            if d.get("instances_wanted", 1) > 1 or d.get("unplaced")
            else []
        ),
        *[f"unplaced    {reason}" for reason in d.get("unplaced", [])],
        f"desired     {d['desired']}  ({_DESIRED[d['desired']]})",
        f"engine      {d['engine']} ({d['engine_family']} {d['engine_version']})",
        f"api         {d['api']}",
        f"residency   {d['residency']}",
        _memory_line(d["memory"]),
        f"endpoint    {d['endpoint']} (attached: CapyCTL does not start or stop it)"
        if d["endpoint"]
        else f"model       {d['model']}",
        f"fields      {'verified' if d['fields']['verified'] else 'UNVERIFIED'}: {d['fields']['row']} "
        f"({d['fields']['provenance']})",
        "",
    ]
    remote = any(i["host"] for i in instances)
    rows = [
        [
            i["index"],
            i["host"] or "-",
            i["device"] or "-",
            i["state"] + (" (retiring)" if i.get("retired") else " (draining)" if i.get("draining") else ""),
            i["in_flight"],
            _load_text(i),
            i["pid"],
            i["port"],
            *([i["ingress_port"]] if remote else []),
            duration(i["uptime_s"]),
            i["restarts"],
            i["last_error"],
        ]
        for i in instances
    ]
    columns = [
        "INSTANCE",
        "HOST",
        "DEVICE",
        "STATE",
        "IN FLIGHT",
        "ENGINE LOAD",
        "PID",
        "PORT",
        *(["INGRESS"] if remote else []),
        "UPTIME",
        "RESTARTS",
        "LAST ERROR",
    ]
    logs = [f"log         {i['log']}" for i in d["instances"] if i["log"]]
    return (
        "\n".join(head)
        + table(columns, rows)
        + (_unsettled_text(d["instances"]))
        + ("\n\n" + "\n".join(logs) if logs else "")
    )


def _load_text(instance: dict[str, Any]) -> str:
    """The engine's own running + waiting count and its age, or ``-`` when no fresh sample stands."""
    load, age = instance.get("engine_load"), instance.get("engine_load_age_s")
    if load is None:
        return "-"
    return (
        f"{load['running']}+{load['waiting']} ({age:.1f} s ago)"
        if age is not None
        else f"{load['running']}+{load['waiting']}"
    )


def _placement_text(placement: dict[str, Any]) -> str:
    parts = [placement["strategy"]]
    if placement["max_per_host"] is not None:
        parts.append(f"at most {placement['max_per_host']} per host")
    if placement["hosts"]:
        parts.append("hosts " + ", ".join(placement["hosts"]))
    if placement["devices"]:
        parts.append("devices " + ", ".join(placement["devices"]))
    return "; ".join(parts)


_SETTLES = {
    "engine_idle": "settles at the engine's next report of 0 running and 0 waiting",
    "engine_stop": "settles at the engine's next stop or restart (it had not answered)",
}


def _unsettled_text(instances: list[dict[str, Any]]) -> str:
    """Under the instance table: the cut requests each instance still counts, and how each settles (CAN-4)."""
    rows = [
        [i["index"], u["count"], u["rule"], _SETTLES.get(u["rule"], "")]
        for i in instances
        for u in i.get("unsettled", [])
    ]
    if not rows:
        return "\n\ncut requests still counted: none"
    return "\n\ncut requests still counted:\n" + table(["INSTANCE", "COUNT", "RULE", "HOW IT SETTLES"], rows)


@status_app.command("deployment")
@reports_errors
def status_deployment(name: str, state_dir: StateDirOpt = None, json: JsonOpt = False) -> None:
    """Show a deployment: state, engine and version, and its instances."""
    deployment = client(state_dir).call("GET", f"/deployments/{name}")
    show(deployment, json, _status_text(deployment))


@start_app.command("deployment")
@reports_errors
def start_deployment(
    name: str,
    wait: Annotated[bool, typer.Option(help="Wait until it is ready.")] = False,
    timeout: TimeoutOpt = 600.0,
    state_dir: StateDirOpt = None,
    json: JsonOpt = False,
) -> None:
    """Start a deployment's engine (and clear an operator's stop)."""
    api = client(state_dir)
    deployment = api.call("POST", f"/deployments/{name}/start")
    if wait:
        deployment = _wait_ready(api, name, timeout, quiet=json)
    show(deployment, json, f"deployment {name} {deployment['state']}")


@stop_app.command("deployment")
@reports_errors
def stop_deployment(name: str, state_dir: StateDirOpt = None, json: JsonOpt = False) -> None:
    """Stop a deployment's engine. Requests get 409 deployment_stopped until it is started again."""
    deployment = client(state_dir).call("POST", f"/deployments/{name}/stop")
    show(deployment, json, f"deployment {name} {deployment['state']}")


@park_app.command("deployment")
@reports_errors
def park_deployment(name: str, state_dir: StateDirOpt = None, json: JsonOpt = False) -> None:
    """Park a deployment after its requests finish: with residency host_backed or deep its engine sleeps and
    keeps its parked footprint; with restart_only it stops. Not sticky: the next request wakes or starts it."""
    deployment = client(state_dir).call("POST", f"/deployments/{name}/park")
    show(deployment, json, f"deployment {name} {deployment['state']}")


@list_app.command("devices")
@reports_errors
def list_devices(state_dir: StateDirOpt = None, json: JsonOpt = False) -> None:
    """List the devices deployments are charged against: capacity, reserve, what each deployment holds."""
    devices = client(state_dir).call("GET", "/devices")
    rows = [
        [
            d["name"],
            gib(d["capacity_bytes"]),
            gib(d["reserve_bytes"]),
            gib(d["charged_bytes"]),
            gib(d["free_bytes"]),
            ", ".join(f"{h['deployment']} {gib(h['bytes'])}" for h in d["holders"]) or "-",
        ]
        for d in devices
    ]
    text = (
        table(["DEVICE", "CAPACITY", "RESERVE", "CHARGED", "FREE", "HELD BY"], rows)
        if devices
        else "no devices: memory.devices is not set in the server's configuration, so no memory limit applies"
    )
    show(devices, json, text)


def gib(size: int | None) -> str:
    return "-" if size is None else f"{size / 2**30:.2f} GiB"


@delete_app.command("deployment")
@reports_errors
def delete_deployment(name: str, state_dir: StateDirOpt = None, json: JsonOpt = False) -> None:
    """Stop and delete a deployment."""
    result = client(state_dir).call("DELETE", f"/deployments/{name}")
    show(result, json, f"deployment {name} deleted")


EVENTS_PAGE = 1000  # events asked of the server at a time


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
        params: dict[str, Any] = {"after": after, "limit": EVENTS_PAGE}
        if deployment:
            params["deployment"] = deployment
        batch = api.call("GET", "/events", params=params)
        for event in batch:
            after = event["id"]
            if json:
                sys.stdout.write(msgspec.json.encode(event).decode() + "\n")
            else:
                detail = " ".join(f"{k}={v}" for k, v in event["detail"].items())
                kind = f"{event['kind']:<20} {detail}" if detail else event["kind"]  # no spaces end a line
                typer.echo(f"{stamp(event['at'])}  {event['deployment'] or '-':<20} {kind}")
        if len(batch) == EVENTS_PAGE:  # a full page: more may follow at once
            continue
        if not follow:
            return
        sys.stdout.flush()
        time.sleep(0.5)
