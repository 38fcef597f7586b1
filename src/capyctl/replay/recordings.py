"""Loading one recording folder: its cases (``.sse`` streams, ``.json`` + ``.headers`` error answers),
their metadata and the pace to serve them at.

A folder's ``metadata.json`` lists the cases and the pace; its ``systemone/`` subfolder, when there is one,
holds the decision cases (``capyctl.replay.decisions``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec

from capyctl.replay.decisions import Decisions, load_decisions


@dataclass(frozen=True, slots=True)
class Case:
    name: str
    kind: str  # "stream" or "error"
    body: bytes  # the whole file, served as is
    events: tuple[bytes, ...] = ()  # stream: each SSE event with its terminating blank line
    status: int = 200  # error: status line of the .headers file
    content_type: bytes = b"application/json"
    expect: str = "ok"
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Recording:
    path: Path
    meta: dict[str, Any]
    cases: dict[str, Case]
    first_chunk_s: float
    interval_s: float
    model: str
    decisions: Decisions = field(default_factory=Decisions)  # the systemone/ subfolder's cases, if any

    @property
    def engine(self) -> str:
        return str(self.meta.get("engine") or self.path.parent.name)

    def default_case(self) -> str:
        if "chat_stream_usage" in self.cases:
            return "chat_stream_usage"
        ok = [c.name for c in self.cases.values() if c.kind == "stream" and c.expect == "ok"]
        if ok:
            return sorted(ok)[0]
        if not self.cases:
            raise ValueError(f"{self.path}: no cases")
        return sorted(self.cases)[0]


def split_events(data: bytes) -> tuple[bytes, ...]:
    """SSE events, each ending with its blank line; a tail without one is kept as a last event."""
    out, start = [], 0
    while (end := data.find(b"\n\n", start)) >= 0:
        out.append(data[start : end + 2])
        start = end + 2
    if start < len(data):
        out.append(data[start:])
    return tuple(out)


def read_metadata(folder: Path) -> dict[str, Any]:
    path = folder / "metadata.json"
    return msgspec.json.decode(path.read_bytes()) if path.exists() else {}


def case_files(folder: Path) -> dict[str, Path]:
    """Case name -> file: every ``.sse``, and every ``.json`` that has a ``.headers`` beside it."""
    found = {p.stem: p for p in folder.glob("*.sse")}
    for p in folder.glob("*.json"):
        if p.with_suffix(".headers").exists():
            found.setdefault(p.stem, p)
    return dict(sorted(found.items()))


def _parse_headers(raw: bytes) -> tuple[int, bytes]:
    lines = raw.replace(b"\r\n", b"\n").split(b"\n")
    status = int(lines[0].split()[1])
    content_type = b"application/json"
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-type":
            content_type = value.strip()
    return status, content_type


def _model_of(events: tuple[bytes, ...]) -> str | None:
    for event in events:
        if event.startswith(b"data: {"):
            try:
                obj = msgspec.json.decode(event[6:])
            except msgspec.DecodeError:
                continue
            model = obj.get("model") if isinstance(obj, dict) else None
            if isinstance(model, str):
                return model
    return None


def load(folder: Path) -> Recording:
    folder = folder.resolve()
    if not folder.is_dir():
        raise FileNotFoundError(f"no recording folder at {folder}")
    meta = read_metadata(folder)
    listed = meta.get("cases") or {}
    cases: dict[str, Case] = {}
    model = None
    for name, path in case_files(folder).items():
        info = listed.get(name) or {}
        body = path.read_bytes()
        if path.suffix == ".sse":
            events = split_events(body)
            model = model or _model_of(events)
            cases[name] = Case(name, "stream", body, events, expect=info.get("expect", "ok"), meta=info)
        else:
            status, ctype = _parse_headers(path.with_suffix(".headers").read_bytes())
            cases[name] = Case(
                name,
                "error",
                body,
                status=status,
                content_type=ctype,
                expect=info.get("expect", "engine_error"),
                meta=info,
            )
    pace = meta.get("pace") or {}
    return Recording(
        path=folder,
        meta=meta,
        cases=cases,
        first_chunk_s=float(pace.get("first_chunk_ms") or 0) / 1000,
        interval_s=float(pace.get("interval_ms") or 0) / 1000,
        model=model or "replay",
        decisions=load_decisions(folder),
    )
