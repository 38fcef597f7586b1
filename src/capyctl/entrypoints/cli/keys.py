"""Named API keys: create, list, revoke (through the management API, with the admin token)."""

from __future__ import annotations

import sys
from typing import Annotated, Any

import typer

from capyctl.entrypoints.cli.common import (
    JsonOpt,
    StateDirOpt,
    client,
    create_app,
    list_app,
    reports_errors,
    revoke_app,
)
from capyctl.entrypoints.cli.output import print_json, show, stamp, table


@create_app.command("key")
@reports_errors
def create_key(
    name: Annotated[str, typer.Argument(help="The key's name: 1-64 letters, digits, '.', '_' or '-'.")],
    daily_limit: Annotated[
        int | None,
        typer.Option(
            "--daily-limit",
            min=1,
            help="Calls per UTC day; past it, 429 daily_limit until 00:00 UTC. Listing models does not count.",
            show_default=False,
        ),
    ] = None,
    models: Annotated[
        str | None,
        typer.Option(
            "--models",
            help="Comma-separated models the key may see and use (others are 'not found' to it). Default: every model.",
            show_default=False,
        ),
    ] = None,
    cache_salt: Annotated[
        str | None,
        typer.Option(
            "--cache-salt",
            help="A cache_salt sent with every request made with the key (vLLM, SGLang): its "
            "tenant's prompt cache is kept apart whatever the client sends.",
            show_default=False,
        ),
    ] = None,
    state_dir: StateDirOpt = None,
    json: JsonOpt = False,
) -> None:
    """Create a named API key and print its secret, once: it is stored only as a hash.

    The secret alone goes to stdout, so `KEY=$(capyctl create key app1)` keeps it; the rest goes to stderr.
    """
    body: dict[str, Any] = {"name": name}
    if daily_limit is not None:
        body["daily_limit"] = daily_limit
    if models is not None:
        body["models"] = [m.strip() for m in models.split(",") if m.strip()]
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    api = client(state_dir)
    key = api.call("POST", "/keys", json=body)
    if json:
        print_json(key)
        return
    sys.stdout.write(key["secret"] + "\n")
    deployed = {d["name"] for d in api.call("GET", "/deployments")}
    missing = [m for m in key["models"] or () if m not in deployed]
    sys.stderr.write(f"key {key['name']} created ({_limits(key)}); the secret above is shown only this once\n")
    if missing:
        sys.stderr.write(f"note: not deployed now: {', '.join(missing)} (the key sees them once they are)\n")


def _limits(key: dict[str, Any]) -> str:
    parts = [
        f"daily limit {key['daily_limit']}" if key["daily_limit"] else "no daily limit",
        f"models {', '.join(key['models'])}" if key["models"] else "every model",
    ]
    if key["cache_salt"]:
        parts.append("cache salt bound")
    return "; ".join(parts)


@list_app.command("keys")
@reports_errors
def list_keys(state_dir: StateDirOpt = None, json: JsonOpt = False) -> None:
    """List the named API keys: never their secrets."""
    keys = client(state_dir).call("GET", "/keys")
    rows = [
        [
            k["name"],
            stamp(k["created"]),
            stamp(k["last_used"]) if k["last_used"] else "never",
            k["daily_limit"] or "none",
            k["used_today"],
            ",".join(k["models"]) if k["models"] else "all",
            "yes" if k["cache_salt"] else "no",
        ]
        for k in keys
    ]
    show(keys, json, table(["NAME", "CREATED", "LAST USED", "DAILY LIMIT", "USED TODAY", "MODELS", "SALT"], rows))


@revoke_app.command("key")
@reports_errors
def revoke_key(
    name: Annotated[str, typer.Argument(help="The key's name (see: capyctl list keys).")],
    state_dir: StateDirOpt = None,
    json: JsonOpt = False,
) -> None:
    """Revoke a key: its very next request gets 401 invalid_api_key. Requests under way finish."""
    revoked = client(state_dir).call("DELETE", f"/keys/{name}")
    show(revoked, json, f"key {name} revoked")
