"""How the CLI prints: tables for people, JSON with --json, errors on stderr."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

import msgspec

# Exit codes by error class (documented in docs/cli.md).
EXIT_CODES: dict[str, int] = {
    "server_not_running": 3,
    "unauthorized": 3,
    "deployment_not_found": 4,
    "engine_not_found": 4,
    "key_not_found": 4,
    "host_not_found": 4,
    "not_found": 4,
    "already_exists": 5,
    "engine_in_use": 5,
    "deployment_stopped": 5,
    "invalid_config": 6,
    "invalid_request": 6,
    "invalid_engine": 6,
    "engine_unavailable": 7,
    "llm-unavailable": 7,
    "deployment_failed": 7,
    "timeout": 8,
}


def exit_code(code: str) -> int:
    return EXIT_CODES.get(code, 1)


def print_json(value: Any) -> None:
    sys.stdout.write(msgspec.json.format(msgspec.json.encode(value), indent=2).decode() + "\n")


def show(value: Any, as_json: bool, text: str) -> None:
    """A command's result: JSON with --json, else the text for people."""
    if as_json:
        print_json(value)
    else:
        sys.stdout.write(text + "\n")


def print_error(code: str, message: str) -> None:
    sys.stderr.write(f"error [{code}]: {message}\n")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [["-" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in cells)


def duration(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def stamp(epoch: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(epoch))
