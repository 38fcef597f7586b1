"""The Charts page's data: per deployment, the request records' figures over a window, and its parks, wakes and
switches on the same time axis.

The figures are the records' own buckets (``domain/request_charts``: TTFT
p50/p95, decode tokens/s, requests/s, CapyCTL's wait p50/p95), read through
``RequestLog.chart``; the marks are those the timeline keeps apart for
them (module ``marks``). Nothing comes from Prometheus or Grafana. The page
draws them with uPlot (``static/charts.js``) from ``GET /ui/charts/data``,
which answers this module's ``Charts`` as JSON. While the page is open, its
live stream sends each deployment's marks in the window (``marks_in``) as they
come, and the page draws its charts again when they change.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec

from capyctl.adapters.dashboard.marks import Mark
from capyctl.domain.errors import InvalidRequest
from capyctl.domain.request_charts import WINDOWS, Bucket, bucket_starts

WINDOW = "1h"  # the window a page shows unless told otherwise
PARAMS = ("window", "deployment")
SERIES = (
    "requests_per_second",
    "errors",
    "ttft_p50_ms",
    "ttft_p95_ms",
    "decode_tokens_per_second_p50",
    "queue_wait_p50_ms",
    "queue_wait_p95_ms",
)  # the figures of a bucket, by the Bucket's own names


class DeploymentChart(msgspec.Struct, frozen=True):
    name: str
    requests: int  # in the whole window
    errors: int
    series: dict[str, list[float | None]]  # by SERIES name, one value per bucket (None: nobody measured it)
    marks: list[Mark]


class Charts(msgspec.Struct, frozen=True):
    window: str
    bucket_seconds: int
    times: list[float]  # the buckets' starts, oldest first
    start: float
    end: float
    deployments: list[DeploymentChart]


def read_params(params: Mapping[str, str]) -> tuple[str, str | None]:
    """The window (``WINDOW`` when blank or not given) and the deployment (None: all) of a query;
    ``InvalidRequest`` naming the parameter at fault."""
    for name in params:
        if name not in PARAMS:
            raise InvalidRequest(f"{name!r} is not a parameter of the charts; give {' and '.join(PARAMS)}", param=name)
    window = params.get("window", "").strip() or WINDOW
    if window not in WINDOWS:
        raise InvalidRequest(f"'window' must be one of {', '.join(WINDOWS)}, not {window!r}", param="window")
    return window, params.get("deployment", "").strip() or None


def window_edges(window: str, now: float) -> tuple[float, float]:
    """Where ``window`` begins and ends when its last bucket holds ``now``."""
    span = WINDOWS[window]
    starts = bucket_starts(span, now)
    return starts[0], starts[-1] + span.bucket


def marks_in(marks: Iterable[Mark], start: float, end: float) -> tuple[Mark, ...]:
    return tuple(m for m in marks if start <= m.at < end)


def charts(
    window: str,
    buckets: Mapping[str, list[Bucket]],
    names: Iterable[str],
    marks: Mapping[str, Iterable[Mark]],
    now: float,
) -> Charts:
    """The charts of ``names`` (those with records in the window too) over ``window`` ending with ``now``'s
    bucket: a deployment without records has empty buckets (0 requests, no figures), never a missing chart."""
    span = WINDOWS[window]
    starts = bucket_starts(span, now)
    for found in buckets.values():  # the records' own edges, read at their own now
        starts = [b.start for b in found]
        break
    start, end = starts[0], starts[-1] + span.bucket
    out = []
    for name in sorted(set(names) | set(buckets)):
        rows = buckets.get(name) or [Bucket(start=t, requests=0, requests_per_second=0.0, errors=0) for t in starts]
        series: dict[str, list[float | None]] = {s: [getattr(b, s) for b in rows] for s in SERIES}
        shown = list(marks_in(marks.get(name, ()), start, end))
        out.append(DeploymentChart(name, sum(b.requests for b in rows), sum(b.errors for b in rows), series, shown))
    return Charts(window, span.bucket, starts, start, end, out)
