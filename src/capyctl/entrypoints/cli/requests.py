"""``capyctl list requests``: the request records, newest first (docs/cli.md, "Requests")."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from capyctl.entrypoints.cli.common import JsonOpt, StateDirOpt, client, list_app, reports_errors
from capyctl.entrypoints.cli.output import show, stamp, table

_COLUMNS = [
    "TIME",
    "ID",
    "KEY",
    "DEPLOYMENT",
    "STATUS",
    "CODE",
    "WAIT_MS",
    "TTFT_MS",
    "TOK/S",
    "PROMPT",
    "CACHED",
    "OUTPUT",
    "CUT",
]


def _cut(row: dict[str, Any]) -> str | None:
    """The cut cause, with how it settles (``engine_idle`` ...) and, once settled, after how long."""
    if row["cause"] is None:
        return None
    if row["settlement"] is None:
        return str(row["cause"])
    settled = "unsettled" if row["settled_s"] is None else f"settled {row['settled_s']}s"
    return f"{row['cause']} ({row['settlement']}, {settled})"


def _rows(rows: list[dict[str, Any]]) -> str:
    return table(
        _COLUMNS,
        [
            [
                stamp(r["at"]),
                r["id"],
                r["key"],
                r["deployment"],
                r["status"],
                r["code"],
                r["queue_wait_ms"],
                r["ttft_ms"],
                r["decode_tokens_per_second"],
                r["prompt_tokens"],
                r["cached_tokens"],
                r["completion_tokens"],
                _cut(r),
            ]
            for r in rows
        ],
    )


@list_app.command("requests")
@reports_errors
def list_requests(
    deployment: Annotated[str | None, typer.Option(help="Only this deployment's requests.")] = None,
    key: Annotated[str | None, typer.Option(help="Only the requests made with this API key (its name).")] = None,
    code: Annotated[
        str | None, typer.Option(help="Only this outcome: ok, or an error code such as queue_full.")
    ] = None,
    status: Annotated[int | None, typer.Option(help="Only answers with this HTTP status, such as 429.")] = None,
    since: Annotated[str | None, typer.Option(help="Only the last stretch of time: 90s, 10m, 1h.")] = None,
    limit: Annotated[int, typer.Option(help="Most rows shown (1 to 1000).")] = 100,
    state_dir: StateDirOpt = None,
    json: JsonOpt = False,
) -> None:
    """List request records, newest first: outcome, wait, TTFT, decode rate, tokens, cut and settlement."""
    params: dict[str, Any] = {"limit": limit}
    for name, value in (("deployment", deployment), ("key", key), ("code", code), ("status", status), ("since", since)):
        if value is not None:
            params[name] = value
    rows = client(state_dir).call("GET", "/requests", params=params)
    show(rows, json, _rows(rows))
