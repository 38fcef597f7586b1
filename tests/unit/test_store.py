"""The SQLite store's events: written off the caller's thread, read back in order, kept within a retention."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

from capyctl.adapters.storage import sqlite as store_module
from capyctl.adapters.storage.sqlite import SqliteStore


def test_a_reader_sees_every_event_emitted_before_it(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "db")
    try:
        for n in range(500):
            store.add_event(time.time(), "a" if n % 2 else "b", "router_selection", {"n": n})
        events = store.list_events("a", 0, 1000)
        assert [e["detail"]["n"] for e in events] == list(range(1, 500, 2))
        assert all(e["deployment"] == "a" for e in events)
    finally:
        store.close()


def test_events_are_inserted_by_the_writer_thread_not_the_caller(tmp_path: Path, monkeypatch) -> None:
    store = SqliteStore(tmp_path / "db")
    inserted_on: list[str] = []
    real_write = store._write
    monkeypatch.setattr(
        store,
        "_write",
        lambda rows, uses: (inserted_on.append(threading.current_thread().name), real_write(rows, uses)),
    )
    try:
        store.add_event(time.time(), "a", "state_changed", {})
        assert inserted_on == []  # add_event only queued it
        deadline = time.monotonic() + 10
        while not inserted_on and time.monotonic() < deadline:  # no read: the writer inserts it by itself
            time.sleep(0.01)
        assert inserted_on == ["capyctl-events"]
        assert store.list_events(None, 0, 10)[0]["kind"] == "state_changed"
    finally:
        store.close()


def test_the_oldest_events_go_past_the_retention_count(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "db", max_events=300)
    try:
        for n in range(2500):
            store.add_event(time.time(), None, "k", {"n": n})
        kept = store.list_events(None, 0, 10_000)
        assert len(kept) <= 300 + store_module._PRUNE_EVERY
        assert kept[-1]["detail"]["n"] == 2499  # the newest are the ones kept
    finally:
        store.close()
    reopened = SqliteStore(tmp_path / "db", max_events=300)  # a start prunes too
    try:
        kept = reopened.list_events(None, 0, 10_000)
        assert [e["detail"]["n"] for e in kept] == list(range(2200, 2500))
    finally:
        reopened.close()


def test_events_older_than_the_retention_age_are_pruned(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "db", max_event_age=3600)
    try:
        store.add_event(time.time() - 7200, "a", "old", {})
        store.add_event(time.time(), "a", "new", {})
        assert len(store.list_events(None, 0, 10)) == 2
    finally:
        store.close()
    reopened = SqliteStore(tmp_path / "db", max_event_age=3600)
    try:
        assert [e["kind"] for e in reopened.list_events(None, 0, 10)] == ["new"]
    finally:
        reopened.close()


def test_reading_one_deployment_uses_its_index(tmp_path: Path) -> None:
    SqliteStore(tmp_path / "db").close()
    db = sqlite3.connect(tmp_path / "db")
    plan = db.execute(
        "EXPLAIN QUERY PLAN SELECT id FROM events WHERE id > 0 AND deployment = 'x' ORDER BY id LIMIT 5"
    ).fetchall()
    db.close()
    assert any("events_by_deployment" in str(row) for row in plan), plan
