"""The request records' pure parts: retention, filters, the buffer's bound, chart buckets."""

from __future__ import annotations

import pytest

from capyctl.domain.errors import InvalidRequest
from capyctl.domain.request_charts import WINDOWS, Recent, Window, bucket_starts, chart, percentile, recent
from capyctl.domain.request_rows import (
    LIMIT_MOST,
    RequestRow,
    Retention,
    RowBuffer,
    RowFilter,
    Settle,
    clip_name,
    pick,
    read_filter,
    retained,
    settled,
)

NOW = 1_800_000_000.0


def row(n: int, at: float = NOW, **fields: object) -> RequestRow:
    return RequestRow(
        id=f"R{n:04d}",
        at=at,
        api="chat",
        code=fields.pop("code", "ok"),  # type: ignore[arg-type]
        deployment=fields.pop("deployment", "m"),
        **fields,
    )  # type: ignore[arg-type]


# --- retention -----------------------------------------------------------------------------------------------
def test_retention_keeps_the_newest_rows_up_to_the_count() -> None:
    rows = [row(n, NOW - 100 + n) for n in range(10)]
    kept = retained(rows, NOW, Retention(max_count=3, max_age=3600))
    assert [r.id for r in kept] == ["R0007", "R0008", "R0009"]


def test_retention_drops_rows_older_than_the_age_whatever_the_count() -> None:
    rows = [row(0, NOW - 7200), row(1, NOW - 3601), row(2, NOW - 3600), row(3, NOW - 5)]
    kept = retained(rows, NOW, Retention(max_count=100, max_age=3600))
    assert [r.id for r in kept] == ["R0002", "R0003"]  # exactly max_age old is still kept


def test_retention_applies_both_bounds_together() -> None:
    rows = [row(n, NOW - 5000 + n * 1000) for n in range(5)]  # ages 5000, 4000, 3000, 2000, 1000
    assert [r.id for r in retained(rows, NOW, Retention(max_count=2, max_age=3500))] == ["R0003", "R0004"]
    assert [r.id for r in retained(rows, NOW, Retention(max_count=4, max_age=2500))] == ["R0003", "R0004"]


def test_a_settlement_fills_in_the_rule_and_rounded_seconds() -> None:
    cut = row(1, cause="client_gone", settlement="engine_idle")
    done = settled(cut, Settle("R0001", "engine_idle", 0.123456))
    assert done.settled_s == 0.123 and done.settlement == "engine_idle" and done.cause == "client_gone"


# --- filters -------------------------------------------------------------------------------------------------
def test_a_filter_matches_every_field_it_sets_and_lists_newest_first() -> None:
    rows = [
        row(0, NOW - 50, deployment="a", key="k1"),
        row(1, NOW - 40, deployment="b", key="k1"),
        row(2, NOW - 30, deployment="a", key="k2", code="queue_full", status=429),
        row(3, NOW - 20, deployment="a", key="k1", status=200),
        row(4, NOW - 10, deployment="a", key="k1"),
    ]
    assert [r.id for r in pick(rows, RowFilter(deployment="a"))] == ["R0004", "R0003", "R0002", "R0000"]
    assert [r.id for r in pick(rows, RowFilter(deployment="a", key="k1"))] == ["R0004", "R0003", "R0000"]
    assert [r.id for r in pick(rows, RowFilter(code="queue_full"))] == ["R0002"]
    assert [r.id for r in pick(rows, RowFilter(status=429))] == ["R0002"]
    assert [r.id for r in pick(rows, RowFilter(since=NOW - 30))] == ["R0004", "R0003", "R0002"]
    assert [r.id for r in pick(rows, RowFilter(limit=2))] == ["R0004", "R0003"]


def test_query_parameters_become_a_filter() -> None:
    where = read_filter(
        {"deployment": "m", "key": "ci", "code": "ok", "status": "200", "since": "10m", "limit": "5"}, NOW
    )
    assert where == RowFilter(deployment="m", key="ci", code="ok", status=200, since=NOW - 600, limit=5)
    assert read_filter({}, NOW) == RowFilter()
    assert read_filter({"since": "90"}, NOW).since == NOW - 90  # a bare number is seconds


@pytest.mark.parametrize(
    ("params", "param", "words"),
    [
        ({"since": "yesterday"}, "since", "duration"),
        ({"since": "0s"}, "since", "more than zero"),
        ({"status": "abc"}, "status", "HTTP status"),
        ({"status": "700"}, "status", "HTTP status"),
        ({"limit": "0"}, "limit", "1 to 1000"),
        ({"limit": str(LIMIT_MOST + 1)}, "limit", "1 to 1000"),
        ({"limit": "-3"}, "limit", "1 to 1000"),
        ({"deployment": ""}, "deployment", "must not be empty"),
        ({"model": "m"}, "model", "not a filter"),
    ],
)
def test_bad_query_parameters_are_refused_naming_the_parameter(params: dict[str, str], param: str, words: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        read_filter(params, NOW)
    assert refused.value.extra["param"] == param and words in refused.value.message


def test_an_unknown_models_name_is_kept_bounded() -> None:
    assert clip_name("m") == "m"
    clipped = clip_name("x" * 10_000)
    assert len(clipped) == 201 and clipped.endswith("…")


# --- the buffer ----------------------------------------------------------------------------------------------
def test_the_buffer_holds_at_most_its_bound_and_counts_what_it_drops() -> None:
    buffer = RowBuffer(3)
    assert [buffer.add(row(n)) for n in range(5)] == [True, True, True, False, False]
    assert len(buffer) == 3 and buffer.dropped == 2
    assert [e.id for e in buffer.take(2)] == ["R0000", "R0001"]  # oldest first
    assert buffer.add(row(9)) and buffer.dropped == 2  # room again once taken
    assert [e.id for e in buffer.take(100)] == ["R0002", "R0009"] and len(buffer) == 0
    assert buffer.take(10) == []


# --- charts --------------------------------------------------------------------------------------------------
def test_percentiles_are_nearest_rank() -> None:
    assert percentile([], 0.5) is None
    assert percentile([7.0], 0.95) == 7.0
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 0.5) == 50.0 and percentile(values, 0.95) == 95.0
    assert percentile([3.0, 1.0, 2.0, 4.0], 0.5) == 2.0


def test_buckets_are_aligned_and_end_with_the_one_holding_now() -> None:
    starts = bucket_starts(Window(900, 30), 1000.0 * 30 + 7)
    assert len(starts) == 30 and starts[-1] == 30_000.0 and starts[0] == 30_000.0 - 29 * 30
    assert all(b - a == 30 for a, b in zip(starts, starts[1:], strict=False))
    for name, window in WINDOWS.items():
        assert window.seconds % window.bucket == 0, name


def test_chart_buckets_per_deployment_with_percentiles_rates_and_waits() -> None:
    window = Window(120, 60)  # two buckets of a minute
    now = 60_000.0 + 59  # the last bucket starts at 60_000
    rows = [
        row(1, 59_940.0 + 1, ttft_ms=100.0, decode_tokens_per_second=40.0, queue_wait_ms=0.0),
        row(2, 59_940.0 + 2, ttft_ms=300.0, decode_tokens_per_second=60.0, queue_wait_ms=2000.0),
        row(3, 59_940.0 + 3, ttft_ms=200.0, decode_tokens_per_second=50.0, queue_wait_ms=10.0),
        row(4, 59_940.0 + 4, code="queue_full", status=429),  # counted, no figures
        row(5, 60_000.0 + 10, deployment="b", ttft_ms=80.0),
        row(6, 59_000.0, ttft_ms=1.0),  # before the window
        row(7, 60_000.0 + 5, deployment=None, code="invalid_api_key"),  # refused before any deployment was read
    ]
    charts = chart(rows, window, now)
    assert sorted(charts) == ["b", "m"]
    first, second = charts["m"]
    assert (first.start, second.start) == (59_940.0, 60_000.0)
    assert first.requests == 4 and first.errors == 1 and first.requests_per_second == round(4 / 60, 4)
    assert (first.ttft_p50_ms, first.ttft_p95_ms) == (200.0, 300.0)
    assert first.decode_tokens_per_second_p50 == 50.0
    assert (first.queue_wait_p50_ms, first.queue_wait_p95_ms) == (10.0, 2000.0)
    assert second.requests == 0 and second.ttft_p50_ms is None and second.requests_per_second == 0
    assert [b.requests for b in charts["b"]] == [0, 1] and charts["b"][1].ttft_p95_ms == 80.0


def test_recent_figures_are_per_deployment_over_the_last_five_minutes_only() -> None:
    rows = [
        row(1, NOW - 10, ttft_ms=100.0, decode_tokens_per_second=40.0),
        row(2, NOW - 20, ttft_ms=300.0, decode_tokens_per_second=60.0),
        row(3, NOW - 30, ttft_ms=200.0),
        row(4, NOW - 40, code="queue_full", status=429),  # counted, no figures
        row(5, NOW - 301, ttft_ms=9999.0),  # older than five minutes
        row(6, NOW - 5, deployment="b", code="engine_error", status=502),
        row(7, NOW - 1, deployment=None, code="invalid_api_key"),
    ]
    assert recent(rows, NOW) == {"m": Recent(4, 200.0, 40.0), "b": Recent(1, None, None)}
    assert recent(rows, NOW + 400) == {}
