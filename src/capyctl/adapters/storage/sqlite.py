"""SQLite store for engines, deployments, events, API keys, request records, hosts and their invitations.

Rows hold msgspec-encoded JSON so the schema follows the domain types.
Engine and deployment calls are short and run on the caller's thread.
Events are many (one per routed request), so ``add_event`` only queues
them: a writer thread inserts them in batches a few times a second, off the
event loop, and
keeps the table within its retention (a count and an age), pruning as it
goes. A read of events first waits for what was queued before it, so a
reader always sees its own writes.

API keys are stored as their digests (never a secret). Their use (calls
counted today, when last used) changes with every request, so it is kept
the same way as events: the newest figures per key are written by the
writer thread with the events, and on close.
"""

from __future__ import annotations

import collections
import logging
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import msgspec

from capyctl.domain.deployments import Deployment
from capyctl.domain.engines import EngineInstall
from capyctl.domain.hosts import HostRecord
from capyctl.domain.joining import Invite
from capyctl.domain.keys import ApiKey
from capyctl.domain.ports import HostStore, RequestStore, Store
from capyctl.domain.request_rows import Entry, RequestRow, Retention, RowFilter, Settle, settled

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
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY, name TEXT NOT NULL UNIQUE, body BLOB NOT NULL, last_used REAL
);
CREATE TABLE IF NOT EXISTS key_usage (
    key_id TEXT NOT NULL, day TEXT NOT NULL, used INTEGER NOT NULL, PRIMARY KEY (key_id, day)
);
CREATE TABLE IF NOT EXISTS meta (name TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS requests (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT NOT NULL UNIQUE,
    at REAL NOT NULL,
    deployment TEXT,
    key TEXT,
    code TEXT NOT NULL,
    status INTEGER,
    body BLOB NOT NULL
);
CREATE INDEX IF NOT EXISTS requests_by_time ON requests (at);
CREATE INDEX IF NOT EXISTS requests_by_deployment ON requests (deployment, seq);
CREATE TABLE IF NOT EXISTS hosts (name TEXT PRIMARY KEY, body BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS invites (secret_hash TEXT PRIMARY KEY, name TEXT NOT NULL, body BLOB NOT NULL);
"""
KEY_USAGE_DAYS = 31  # days of per-key counts kept
MAX_EVENTS = 100_000  # stored events kept at most; the oldest go first
MAX_EVENT_AGE = 30 * 86400.0  # seconds an event is kept
_PRUNE_EVERY = 1000  # inserts between two prunes
_FLUSH_EVERY = 0.2  # seconds between two inserts of the queued events
_ROWS_PER_INSERT = 200  # events in one INSERT statement (800 parameters, within SQLite's oldest limit of 999)
_INSERT_EVENTS = "INSERT INTO events (at, deployment, kind, detail) VALUES "
log = logging.getLogger("capyctl.store")

_encode = msgspec.json.encode
_engine = msgspec.json.Decoder(EngineInstall)
_deployment = msgspec.json.Decoder(Deployment)
_detail = msgspec.json.Decoder(dict[str, Any])
_key = msgspec.json.Decoder(ApiKey)
_row = msgspec.json.Decoder(RequestRow)
_host = msgspec.json.Decoder(HostRecord)
_invite = msgspec.json.Decoder(Invite)
_INSERT_REQUEST = (
    "INSERT OR IGNORE INTO requests (id, at, deployment, key, code, status, body) VALUES (?, ?, ?, ?, ?, ?, ?)"
)


class SqliteStore(Store, RequestStore, HostStore):
    def __init__(self, path: Path, max_events: int = MAX_EVENTS, max_event_age: float = MAX_EVENT_AGE) -> None:
        path.touch(mode=0o600)  # API key digests and request events: for CapyCTL's user only (so are WAL files)
        path.chmod(0o600)
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        # WAL + NORMAL: no fsync per event; a power cut may lose the last events, never corrupt the file
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)
        self._lock = threading.Lock()  # one statement at a time on the shared connection
        self._max_events = max_events
        self._max_age = max_event_age
        self._pending: collections.deque[tuple[Any, ...]] = collections.deque()
        self._key_uses: dict[str, tuple[str, int, float | None]] = {}  # key id -> (day, used, last used)
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
        """Insert what is queued, in order, and the keys' newest figures, in one transaction; a reader calls
        it too, so that it sees its own writes."""
        rows: list[tuple[Any, ...]] = []
        try:
            with self._lock:
                while self._pending:
                    rows.append(self._pending.popleft())
                uses, self._key_uses = self._key_uses, {}
                if rows or uses:
                    self._write(rows, uses)
                self._since_prune += len(rows)
                prune = self._since_prune >= _PRUNE_EVERY
                if prune:
                    self._since_prune = 0
            if prune:
                self._prune()
        except sqlite3.Error:  # a full disk must not stop the server: the events are lost, and said so
            log.exception("could not store %d events", len(rows))

    def _write(self, rows: list[tuple[Any, ...]], uses: dict[str, tuple[str, int, float | None]]) -> None:
        self._db.execute("BEGIN")
        try:
            for start in range(0, len(rows), _ROWS_PER_INSERT):  # (executemany steps, and lets go of the
                group = rows[start : start + _ROWS_PER_INSERT]  # GIL, once a row: a thread switch each time)
                self._db.execute(
                    _INSERT_EVENTS + ", ".join(["(?, ?, ?, ?)"] * len(group)), [value for row in group for value in row]
                )
            self._db.executemany(
                "INSERT INTO key_usage VALUES (?, ?, ?) ON CONFLICT (key_id, day) DO UPDATE SET used = excluded.used",
                [(key_id, day, used) for key_id, (day, used, _) in uses.items()],
            )
            self._db.executemany(
                "UPDATE api_keys SET last_used = ? WHERE id = ?",
                [(last, key_id) for key_id, (_, _, last) in uses.items() if last is not None],
            )
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

    # --- API keys -----------------------------------------------------------------------------------
    def list_keys(self) -> list[tuple[ApiKey, float | None]]:
        """Every key with when it was last used (None: never)."""
        self._flush()
        return [(_key.decode(r[0]), r[1]) for r in self._execute("SELECT body, last_used FROM api_keys ORDER BY name")]

    def add_key(self, key: ApiKey) -> None:
        self._execute("INSERT INTO api_keys (id, name, body) VALUES (?, ?, ?)", (key.id, key.name, _encode(key)))

    def delete_key(self, key_id: str) -> None:
        with self._lock:
            self._key_uses.pop(key_id, None)
            self._db.execute("BEGIN")
            self._db.execute("DELETE FROM api_keys WHERE id = ?", (key_id,))
            self._db.execute("DELETE FROM key_usage WHERE key_id = ?", (key_id,))
            self._db.execute("COMMIT")

    def key_usage(self, day: str) -> dict[str, int]:
        """Calls counted on ``day`` per key id; forgets counts older than a month."""
        self._flush()
        self._execute("DELETE FROM key_usage WHERE day < date(?, ?)", (day, f"-{KEY_USAGE_DAYS} days"))
        return dict(self._execute("SELECT key_id, used FROM key_usage WHERE day = ?", (day,)))

    def note_key_use(self, key_id: str, day: str, used: int, last_used: float | None) -> None:
        """Queue a key's newest figures for the writer thread (only the newest per key is written)."""
        self._key_uses[key_id] = (day, used, last_used)

    def get_meta(self, name: str) -> str | None:
        rows = self._execute("SELECT value FROM meta WHERE name = ?", (name,))
        return rows[0][0] if rows else None

    def set_meta(self, name: str, value: str) -> None:
        self._execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (name, value))

    # --- hosts and their invitations (several machines) --------------------------------------------
    def put_host(self, host: HostRecord) -> None:
        self._execute("INSERT OR REPLACE INTO hosts VALUES (?, ?)", (host.name, _encode(host)))

    def list_hosts(self) -> list[HostRecord]:
        return [_host.decode(row[0]) for row in self._execute("SELECT body FROM hosts ORDER BY name")]

    def put_invite(self, invite: Invite) -> None:
        self._execute(
            "INSERT OR REPLACE INTO invites VALUES (?, ?, ?)", (invite.secret_hash, invite.name, _encode(invite))
        )

    def get_invite(self, secret_hash: str) -> Invite | None:
        rows = self._execute("SELECT body FROM invites WHERE secret_hash = ?", (secret_hash,))
        return _invite.decode(rows[0][0]) if rows else None

    def prune_invites(self, before: float) -> None:
        """Invitations that ended (used or expired) before ``before`` are forgotten."""
        for invite in [_invite.decode(row[0]) for row in self._execute("SELECT body FROM invites")]:
            if min(invite.expires_at, invite.used_at or invite.expires_at) < before:
                self._execute("DELETE FROM invites WHERE secret_hash = ?", (invite.secret_hash,))

    # --- request records ------------------------------------------------------------------------------
    def add_requests(self, entries: list[Entry]) -> None:
        with self._lock:
            self._db.execute("BEGIN")
            try:
                for entry in entries:
                    if isinstance(entry, Settle):
                        self._settle(entry)
                    else:
                        self._db.execute(
                            _INSERT_REQUEST,
                            (entry.id, entry.at, entry.deployment, entry.key, entry.code, entry.status, _encode(entry)),
                        )
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def _settle(self, entry: Settle) -> None:
        found = self._db.execute("SELECT body FROM requests WHERE id = ?", (entry.id,)).fetchone()
        if found is not None:  # (a row already gone by retention stays gone)
            self._db.execute(
                "UPDATE requests SET body = ? WHERE id = ?", (_encode(settled(_row.decode(found[0]), entry)), entry.id)
            )

    def prune_requests(self, retention: Retention, now: float) -> None:
        self._execute(
            "DELETE FROM requests WHERE seq <= (SELECT MAX(seq) FROM requests) - ? OR at < ?",
            (retention.max_count, retention.oldest_kept(now)),
        )

    def list_requests(self, where: RowFilter) -> list[RequestRow]:
        query = "SELECT body FROM requests WHERE 1"
        args: list[str | int | float] = []
        for column, value in (
            ("deployment", where.deployment),
            ("key", where.key),
            ("code", where.code),
            ("status", where.status),
        ):
            if value is not None:
                query += f" AND {column} = ?"
                args.append(value)
        if where.since is not None:
            query += " AND at >= ?"
            args.append(where.since)
        rows = self._execute(query + " ORDER BY seq DESC LIMIT ?", [*args, where.limit])
        return [_row.decode(r[0]) for r in rows]

    def get_request(self, request_id: str) -> RequestRow | None:
        rows = self._execute("SELECT body FROM requests WHERE id = ?", (request_id,))
        return _row.decode(rows[0][0]) if rows else None
