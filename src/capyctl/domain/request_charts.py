"""Charts of the request records: per deployment, figures over time windows of 15 minutes, 1 hour, 24 hours.

Each window is cut into buckets of a fixed width, aligned on multiples of
that width (so two reads a few seconds apart give the same bucket edges) and
ending with the bucket that holds ``now``. Empty buckets are kept, with 0
requests and no figures, so a chart's time axis has no holes.

Per bucket: requests and requests per second (every row, refusals too), the
errors among them, TTFT p50/p95 and the median decode rate of the answers
that measured them, and CapyCTL's wait in line p50/p95 of the requests that
waited for an engine. Percentiles are nearest-rank: always a value that was
measured, never one made up between two.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import msgspec

from capyctl.domain.request_rows import RequestRow


class Window(msgspec.Struct, frozen=True):
    seconds: int
    bucket: int  # seconds in one bucket


WINDOWS: dict[str, Window] = {
    "15m": Window(900, 30),
    "1h": Window(3600, 60),
    "24h": Window(86400, 1800),
}


class Bucket(msgspec.Struct, frozen=True, kw_only=True):
    start: float  # wall time the bucket begins at; it ends where the next begins
    requests: int
    requests_per_second: float
    errors: int  # rows whose code is not "ok"
    ttft_p50_ms: float | None = None
    ttft_p95_ms: float | None = None
    decode_tokens_per_second_p50: float | None = None
    queue_wait_p50_ms: float | None = None
    queue_wait_p95_ms: float | None = None


def percentile(values: Sequence[float], p: float) -> float | None:
    """The nearest-rank ``p`` percentile (0 < p <= 1) of ``values``; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p * len(ordered)) - 1)]


def bucket_starts(window: Window, now: float) -> list[float]:
    """The starts of the window's buckets, oldest first; the last bucket holds ``now``."""
    last = math.floor(now / window.bucket) * window.bucket
    count = window.seconds // window.bucket
    return [float(last - window.bucket * i) for i in range(count - 1, -1, -1)]


def chart(rows: Iterable[RequestRow], window: Window, now: float) -> dict[str, list[Bucket]]:
    """Per deployment (rows without one are left out), the window's buckets ending with ``now``'s."""
    starts = bucket_starts(window, now)
    first, end = starts[0], starts[-1] + window.bucket
    grouped: dict[str, list[list[RequestRow]]] = {}
    for row in rows:
        if row.deployment is None or not first <= row.at < end:
            continue
        slots = grouped.get(row.deployment)
        if slots is None:
            slots = grouped[row.deployment] = [[] for _ in starts]
        slots[int((row.at - first) // window.bucket)].append(row)
    return {
        name: [_bucket(start, window.bucket, rows) for start, rows in zip(starts, slots, strict=True)]
        for name, slots in sorted(grouped.items())
    }


def _bucket(start: float, width: int, rows: list[RequestRow]) -> Bucket:
    ttft = [r.ttft_ms for r in rows if r.ttft_ms is not None]
    decode = [r.decode_tokens_per_second for r in rows if r.decode_tokens_per_second is not None]
    waits = [r.queue_wait_ms for r in rows if r.queue_wait_ms is not None]
    return Bucket(
        start=start,
        requests=len(rows),
        requests_per_second=round(len(rows) / width, 4),
        errors=sum(1 for r in rows if r.code != "ok"),
        ttft_p50_ms=percentile(ttft, 0.5),
        ttft_p95_ms=percentile(ttft, 0.95),
        decode_tokens_per_second_p50=percentile(decode, 0.5),
        queue_wait_p50_ms=percentile(waits, 0.5),
        queue_wait_p95_ms=percentile(waits, 0.95),
    )


RECENT_SECONDS = 300  # the Fleet cards' "last 5 minutes"


class Recent(msgspec.Struct, frozen=True):
    """One deployment's answers over the last ``RECENT_SECONDS``: how many, TTFT p50 and decode p50."""

    requests: int
    ttft_p50_ms: float | None
    decode_tokens_per_second_p50: float | None


def recent(rows: Iterable[RequestRow], now: float, seconds: float = RECENT_SECONDS) -> dict[str, Recent]:
    """Per deployment, the rows that ended in the ``seconds`` up to ``now`` (refusals counted, figures from
    the answers that measured them)."""
    grouped: dict[str, list[RequestRow]] = {}
    for row in rows:
        if row.deployment is not None and now - seconds <= row.at <= now:
            grouped.setdefault(row.deployment, []).append(row)
    return {
        name: Recent(
            len(found),
            percentile([r.ttft_ms for r in found if r.ttft_ms is not None], 0.5),
            percentile([r.decode_tokens_per_second for r in found if r.decode_tokens_per_second is not None], 0.5),
        )
        for name, found in grouped.items()
    }
