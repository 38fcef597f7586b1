"""The SQLite store's request records: written in batches, filtered, settled in place, kept within a
retention by count and by age, exactly as the domain's own rules say."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from capyctl.adapters.storage.sqlite import SqliteStore
from capyctl.domain.request_rows import RequestRow, Retention, RowFilter, Settle, pick, retained


def row(n: int, at: float, **fields: object) -> RequestRow:
    return RequestRow(
        id=f"01R{n:05d}",
        at=at,
        api="chat",
        code=fields.pop("code", "ok"),  # type: ignore[arg-type]
        deployment=fields.pop("deployment", "m"),
        key="ci",
        **fields,
    )  # type: ignore[arg-type]


@pytest.fixture
def store(tmp_path: Path):  # type: ignore[no-untyped-def]
    store = SqliteStore(tmp_path / "capyctl.db")
    yield store
    store.close()


def test_rows_come_back_whole_newest_first_and_by_each_filter(store: SqliteStore) -> None:
    now = time.time()
    rows = [
        row(
            0,
            now - 50,
            ttft_ms=12.5,
            prompt_tokens=37,
            cached_tokens=0,
            completion_tokens=4,
            decode_tokens_per_second=490.48,
            queue_wait_ms=0.0,
            instance=0,
            status=200,
            stream=True,
        ),
        row(1, now - 40, deployment="b", code="model_not_found", status=404),
        row(2, now - 30, code="queue_full", status=429),
        row(3, now - 20),
    ]
    store.add_requests(rows)
    assert store.list_requests(RowFilter()) == rows[::-1]
    for where in [
        RowFilter(deployment="m"),
        RowFilter(deployment="b"),
        RowFilter(code="queue_full"),
        RowFilter(status=404),
        RowFilter(key="ci", limit=2),
        RowFilter(key="other"),
        RowFilter(since=now - 35),
        RowFilter(deployment="m", since=now - 45, limit=1),
    ]:
        assert store.list_requests(where) == pick(rows, where), where
    assert store.get_request("01R00000") == rows[0] and store.get_request("01R99999") is None


def test_a_settlement_updates_its_row_in_the_same_batch_or_a_later_one(store: SqliteStore) -> None:
    now = time.time()
    cut = row(1, now, cause="client_gone", settlement="engine_idle")
    store.add_requests([cut, row(2, now, cause="deadline", settlement="engine_stop")])
    store.add_requests([Settle("01R00001", "engine_idle", 0.4567), Settle("01R00404", "engine_stop", 1.0)])
    got = store.get_request("01R00001")
    assert got is not None and got.settled_s == 0.457 and got.settlement == "engine_idle"
    assert store.get_request("01R00002").settled_s is None  # type: ignore[union-attr]
    store.add_requests(
        [row(3, now, cause="client_gone", settlement="engine_idle"), Settle("01R00003", "engine_idle", 0.1)]
    )
    assert store.get_request("01R00003").settled_s == 0.1  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "retention",
    [Retention(max_count=3, max_age=3600), Retention(max_count=100, max_age=25), Retention(max_count=2, max_age=45)],
)
def test_pruning_keeps_what_the_domain_rule_keeps(store: SqliteStore, retention: Retention) -> None:
    now = time.time()
    rows = [row(n, now - 60 + n * 10) for n in range(6)]  # ages 60, 50, 40, 30, 20, 10
    store.add_requests(rows)
    store.prune_requests(retention, now)
    assert store.list_requests(RowFilter(limit=1000)) == retained(rows, now, retention)[::-1]


def test_the_same_id_twice_is_written_once(store: SqliteStore) -> None:
    now = time.time()
    store.add_requests([row(1, now)])
    store.add_requests([row(1, now + 1, code="late")])
    assert store.list_requests(RowFilter()) == [row(1, now)]
