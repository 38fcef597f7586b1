"""SQLite store for engines, deployments and events.

Rows hold msgspec-encoded JSON so the schema follows the domain types.
Engine and deployment calls are short and run on the caller's thread.
Events are many (one per routed request), so ``add_event`` only queues
them: a writer thread inserts them in batches a few times a second, off the
event loop, and
keeps the table within its retention (a count and an age), pruning as it
goes. A read of events first waits for what was queued before it, so a
reader always sees its own writes.
"""

from __future__ import annotations

import logging
import collections
import sqlite3
import threading
import time
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
CREATE INDEX IF NOT EXISTS events_by_deployment ON events (deployment, id);
CREATE INDEX IF NOT EXISTS events_by_time ON events (at);
"""
MAX_EVENTS = 100_000  # stored events kept at most; the oldest go first
MAX_EVENT_AGE = 30 * 86400.0  # seconds an event is kept
_PRUNE_EVERY = 1000  # inserts between two prunes
_FLUSH_EVERY = 0.2  # seconds between two inserts of the queued events
log = logging.getLogger("capyctl.store")

_encode = msgspec.json.encode
_engine = msgspec.json.Decoder(EngineInstall)
_deployment = msgspec.json.Decoder(Deployment)
_detail = msgspec.json.Decoder(dict[str, Any])


class SqliteStore(Store):
    def __init__(self, path: Path, max_events: int = MAX_EVENTS, max_event_age: float = MAX_EVENT_AGE) -> None:
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        # WAL + NORMAL: no fsync per event; a power cut may lose the last events, never corrupt the file
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()  # one statement at a time on the shared connection
        self._max_events = max_events
        self._max_age = max_event_age
        self._pending: collections.deque[tuple[Any, ...]] = collections.deque()
        self._since_prune = 0
        self._stop = threading.Event()
        self._writer = threading.Thread(target=self._write_events, name="capyctl-events", daemon=True)
        self._writer.start()
        self._prune()

    def close(self) -> None:
        self._stop.set()
        self._writer.join()
        self._flush()
        self._db.close()

    def _write_events(self) -> None:
        # Wakes a few times a second rather than per event: a wake per request cost the relay
        # more (thread switches on a busy event loop) than the insert itself.
        while not self._stop.wait(_FLUSH_EVERY):
            self._flush()

    def _flush(self) -> None:
        """Insert what is queued, in order; a reader calls it too, so that it sees its own writes."""
        rows: list[tuple[Any, ...]] = []
        try:
            with self._lock:
                while self._pending:
                    rows.append(self._pending.popleft())
                if rows:
                    self._insert(rows)
                self._since_prune += len(rows)
                prune = self._since_prune >= _PRUNE_EVERY
                if prune:
                    self._since_prune = 0
            if prune:
                self._prune()
        except sqlite3.Error:  # a full disk must not stop the server: the events are lost, and said so
            log.exception("could not store %d events", len(rows))

    def _insert(self, rows: list[tuple[Any, ...]]) -> None:
        self._db.execute("BEGIN")
        try:
            self._db.executemany("INSERT INTO events (at, deployment, kind, detail) VALUES (?, ?, ?, ?)", rows)
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _prune(self) -> None:
        with self._lock:
            self._db.execute(
                "DELETE FROM events WHERE id <= (SELECT MAX(id) FROM events) - ? OR at < ?",
                (self._max_events, time.time() - self._max_age),
            )

    def _execute(self, sql: str, args: Any = ()) -> list[Any]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def put_engine(self, engine: EngineInstall) -> None:
        self._execute("INSERT OR REPLACE INTO engines VALUES (?, ?)", (engine.name, _encode(engine)))

    def get_engine(self, name: str) -> EngineInstall | None:
        rows = self._execute("SELECT body FROM engines WHERE name = ?", (name,))
        row = rows[0] if rows else None
        return _engine.decode(row[0]) if row else None

    def list_engines(self) -> list[EngineInstall]:
        return [_engine.decode(r[0]) for r in self._execute("SELECT body FROM engines ORDER BY name")]

    def delete_engine(self, name: str) -> None:
        self._execute("DELETE FROM engines WHERE name = ?", (name,))

    def put_deployment(self, deployment: Deployment) -> None:
        self._execute("INSERT OR REPLACE INTO deployments VALUES (?, ?)", (deployment.spec.name, _encode(deployment)))

    def get_deployment(self, name: str) -> Deployment | None:
        rows = self._execute("SELECT body FROM deployments WHERE name = ?", (name,))
        row = rows[0] if rows else None
        return _deployment.decode(row[0]) if row else None

    def list_deployments(self) -> list[Deployment]:
        rows = self._execute("SELECT body FROM deployments ORDER BY name")
        return [_deployment.decode(r[0]) for r in rows]

    def delete_deployment(self, name: str) -> None:
        self._execute("DELETE FROM deployments WHERE name = ?", (name,))

    def add_event(self, at: float, deployment: str | None, kind: str, detail: dict[str, Any]) -> None:
        """Queue the event for the writer thread; returns at once."""
        self._pending.append((at, deployment, kind, _encode(detail)))

    def list_events(self, deployment: str | None, after_id: int, limit: int) -> list[dict[str, Any]]:
        self._flush()  # what was emitted before this read is in the table
        query = "SELECT id, at, deployment, kind, detail FROM events WHERE id > ?"
        args: list[Any] = [after_id]
        if deployment is not None:
            query += " AND deployment = ?"
            args.append(deployment)
        query += " ORDER BY id LIMIT ?"
        args.append(limit)
        return [
            {"id": r[0], "at": r[1], "deployment": r[2], "kind": r[3], "detail": _detail.decode(r[4])}
            for r in self._execute(query, args)
        ]
