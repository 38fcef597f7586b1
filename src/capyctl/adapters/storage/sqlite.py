"""SQLite store for engines, deployments and events.

Rows hold msgspec-encoded JSON so the schema follows the domain types.
Calls are short; they run on the event loop's thread.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

import msgspec

from capyctl.domain.deployments import Deployment
from capyctl.domain.engines import EngineInstall
from capyctl.domain.ports import Store

_SCHEMA = """
CREATE TABLE IF NOT EXISTS engines (name TEXT PRIMARY KEY, body BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS deployments (name TEXT PRIMARY KEY, body BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    deployment TEXT,
    kind TEXT NOT NULL,
    detail BLOB NOT NULL
);
"""

_encode = msgspec.json.encode
_engine = msgspec.json.Decoder(EngineInstall)
_deployment = msgspec.json.Decoder(Deployment)
_detail = msgspec.json.Decoder(dict[str, Any])


class SqliteStore(Store):
    def __init__(self, path: Path) -> None:
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        # WAL + NORMAL: no fsync per event; a power cut may lose the last events, never corrupt the file
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    def put_engine(self, engine: EngineInstall) -> None:
        self._db.execute("INSERT OR REPLACE INTO engines VALUES (?, ?)", (engine.name, _encode(engine)))

    def get_engine(self, name: str) -> EngineInstall | None:
        row = self._db.execute("SELECT body FROM engines WHERE name = ?", (name,)).fetchone()
        return _engine.decode(row[0]) if row else None

    def list_engines(self) -> list[EngineInstall]:
        return [_engine.decode(r[0]) for r in self._db.execute("SELECT body FROM engines ORDER BY name")]

    def delete_engine(self, name: str) -> None:
        self._db.execute("DELETE FROM engines WHERE name = ?", (name,))

    def put_deployment(self, deployment: Deployment) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO deployments VALUES (?, ?)", (deployment.spec.name, _encode(deployment))
        )

    def get_deployment(self, name: str) -> Deployment | None:
        row = self._db.execute("SELECT body FROM deployments WHERE name = ?", (name,)).fetchone()
        return _deployment.decode(row[0]) if row else None

    def list_deployments(self) -> list[Deployment]:
        rows = self._db.execute("SELECT body FROM deployments ORDER BY name")
        return [_deployment.decode(r[0]) for r in rows]

    def delete_deployment(self, name: str) -> None:
        self._db.execute("DELETE FROM deployments WHERE name = ?", (name,))

    def add_event(self, at: float, deployment: str | None, kind: str, detail: dict[str, Any]) -> None:
        self._db.execute(
            "INSERT INTO events (at, deployment, kind, detail) VALUES (?, ?, ?, ?)",
            (at, deployment, kind, _encode(detail)),
        )

    def list_events(self, deployment: str | None, after_id: int, limit: int) -> list[dict[str, Any]]:
        query = "SELECT id, at, deployment, kind, detail FROM events WHERE id > ?"
        args: list[Any] = [after_id]
        if deployment is not None:
            query += " AND deployment = ?"
            args.append(deployment)
        query += " ORDER BY id LIMIT ?"
        args.append(limit)
        return [
            {"id": r[0], "at": r[1], "deployment": r[2], "kind": r[3], "detail": _detail.decode(r[4])}
            for r in self._db.execute(query, args)
        ]
