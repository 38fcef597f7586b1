"""Recorded answers to ``POST /v1/systemone`` (the System One decisions API), and a log of what was asked.

A recording folder's decisions live in its ``systemone/`` subfolder, three files a case, as they
were captured: ``<case>.request.json`` (the body the engine was sent), ``<case>.response.headers``
(the status line and headers it answered) and ``<case>.response.json`` (the body it answered), with
a ``metadata.json`` listing the cases. A folder without ``systemone/`` has no such route, like an
engine version without it.

A request is matched to its case by its body: ``replay_case`` names one (as for chat; CapyCTL
refuses that field, so this is for direct use), else the recorded request equal to it as JSON
(key order and spacing aside, ``model`` included), else, for a body that is not JSON, the same bytes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

SUBFOLDER = "systemone"
REQUEST, HEADERS, RESPONSE = ".request.json", ".response.headers", ".response.json"
# set by the replay engine's own HTTP server (or meaningless for it): never replayed from a recording
_OWN_HEADERS = frozenset({b"date", b"server", b"content-length", b"connection", b"keep-alive", b"transfer-encoding"})
LOG_SIZE = 1000


@dataclass(frozen=True, slots=True)
class Decision:
    name: str
    request: bytes  # the recorded request, as the engine was sent it
    status: int
    headers: tuple[tuple[bytes, bytes], ...]  # the recorded ones, less those in _OWN_HEADERS
    body: bytes  # served as is
    expect: str = "ok"
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Decisions:
    meta: dict[str, Any] = field(default_factory=dict)
    cases: dict[str, Decision] = field(default_factory=dict)
    by_request: dict[bytes, str] = field(default_factory=dict)  # request_key -> case

    def match(self, body: bytes) -> tuple[Decision | None, str]:
        """The case for this request body, and how it was found (or why none was)."""
        key = request_key(body)
        named = _replay_case(body)
        if named is not None:
            case = self.cases.get(named)
            return case, "replay_case" if case else f"replay case {named!r} not found"
        name = self.by_request.get(key)
        if name is None:
            return None, "no recorded decision request matches this body (or name one with replay_case)"
        return self.cases[name], "body"


def request_key(body: bytes) -> bytes:
    """A body as canonical JSON (keys sorted, no spaces); a body that is not JSON, its bytes less outer spaces."""
    try:
        return b"j" + msgspec.json.encode(msgspec.json.decode(body), order="sorted")
    except (msgspec.DecodeError, RecursionError):
        return b"b" + body.strip()


def _replay_case(body: bytes) -> str | None:
    try:
        obj = msgspec.json.decode(body)
    except (msgspec.DecodeError, RecursionError):
        return None
    name = obj.get("replay_case") if isinstance(obj, dict) else None
    return name if isinstance(name, str) else None


def _parse_headers(raw: bytes) -> tuple[int, tuple[tuple[bytes, bytes], ...]]:
    lines = raw.replace(b"\r\n", b"\n").split(b"\n")
    status = int(lines[0].split()[1])
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        name = name.strip().lower()
        if sep and name and name not in _OWN_HEADERS:
            headers.append((name, value.strip()))
    return status, tuple(headers)


def load_decisions(folder: Path) -> Decisions:
    """The ``systemone/`` cases of one recording folder; none when it has no such subfolder."""
    where = folder / SUBFOLDER
    if not where.is_dir():
        return Decisions()
    meta_path = where / "metadata.json"
    meta = msgspec.json.decode(meta_path.read_bytes()) if meta_path.exists() else {}
    listed = meta.get("cases") or {}
    cases: dict[str, Decision] = {}
    by_request: dict[bytes, str] = {}
    for path in sorted(where.glob("*" + REQUEST)):
        name = path.name[: -len(REQUEST)]
        headers, response = where / (name + HEADERS), where / (name + RESPONSE)
        if not (headers.exists() and response.exists()):
            raise ValueError(f"{where}: case {name} has a request but no {HEADERS} and {RESPONSE}")
        status, kept = _parse_headers(headers.read_bytes())
        info = listed.get(name) or {}
        request = path.read_bytes()
        key = request_key(request)
        if key in by_request:  # the same request cannot have two recorded answers
            raise ValueError(f"{where}: cases {by_request[key]} and {name} record the same request")
        by_request[key] = name
        cases[name] = Decision(
            name,
            request,
            status,
            kept,
            response.read_bytes(),
            expect=info.get("expect", "ok" if status == 200 else "engine_rejected"),
            meta=info,
        )
    return Decisions(meta, cases, by_request)


class DecisionLog:
    """Every decision request received (the last ``LOG_SIZE``): headers, body, the case served and its status."""

    def __init__(self) -> None:
        self.requests = 0
        self.entries: deque[dict[str, Any]] = deque(maxlen=LOG_SIZE)

    def add(self, headers: list[tuple[bytes, bytes]], body: bytes, case: str | None, status: int) -> None:
        self.requests += 1
        self.entries.append(
            {
                "headers": [[k.decode("latin-1"), v.decode("latin-1")] for k, v in headers],
                "body": body.decode("utf-8", "replace"),
                "case": case,
                "status": status,
            }
        )

    def stats(self) -> dict[str, Any]:
        return {"requests": self.requests, "log": list(self.entries)}
