"""RequestStats: per-request figures held in a list and counted when Prometheus reads them."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from capyctl.adapters.http import prometheus
from capyctl.adapters.http.prometheus import RequestStats


def _stats() -> RequestStats:
    fleet: Any = SimpleNamespace(deployments=lambda: [], room=SimpleNamespace(devices={}, every_device=lambda: []))
    admission: Any = SimpleNamespace(state=None, on_wait=None)
    return RequestStats(fleet, admission)


def _samples(stats: RequestStats) -> dict[str, float]:
    samples = {}
    for line in stats.exposition().decode().splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_answers_first_chunks_and_waits_are_all_in_the_next_scrape() -> None:
    stats = _stats()
    stats.answered("m", "ok", 120.0, "alice")
    stats.answered("m", "ok", 80.0, "alice")
    stats.answered("m", "queue_full", None, "bob")
    stats.relayed_first_chunk("m", 0.0007)
    stats.waited("m", 0.2)
    samples = _samples(stats)
    assert samples['capyctl_requests_total{code="ok",deployment="m",key="alice"}'] == 2
    assert samples['capyctl_requests_total{code="queue_full",deployment="m",key="bob"}'] == 1
    assert samples['capyctl_time_to_first_token_seconds_count{deployment="m"}'] == 2
    assert samples['capyctl_time_to_first_token_seconds_sum{deployment="m"}'] == pytest.approx(0.2)
    assert samples['capyctl_time_to_first_token_seconds_bucket{deployment="m",le="0.1"}'] == 1
    assert samples['capyctl_relay_latency_seconds_bucket{deployment="m",le="0.001"}'] == 1
    assert samples['capyctl_relay_latency_seconds_bucket{deployment="m",le="0.0005"}'] == 0
    assert samples['capyctl_queue_wait_seconds_count{deployment="m"}'] == 1
    stats.answered("m", "ok", None, "alice")
    again = _samples(stats)  # counted once each: what an earlier scrape counted is not counted again
    assert again['capyctl_requests_total{code="ok",deployment="m",key="alice"}'] == 3
    assert again['capyctl_time_to_first_token_seconds_count{deployment="m"}'] == 2


def test_a_labelled_series_is_made_with_its_first_request_not_at_the_scrape() -> None:
    stats = _stats()
    stats.answered("m", "ok", 50.0, "alice")
    # (prometheus_client's children by label values: its _created time is when the series was made)
    assert ("m", "ok", "alice") in stats.requests._metrics
    assert ("m",) in stats.ttft._metrics
    assert ("m",) not in stats.relay._metrics


def test_held_figures_are_counted_without_a_scrape_once_there_are_many(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(prometheus, "_HELD_MOST", 10)
    stats = _stats()
    for _ in range(5):
        stats.answered("m", "ok", 10.0)  # two figures each: the fifth reaches ten
    assert stats.requests.labels("m", "ok", "-")._value.get() == 5
    assert stats._held == []
