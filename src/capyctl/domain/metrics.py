"""Per-request metrics: one vocabulary whatever engine answered.

The metrics table says, per engine and version, where each figure comes
from: a field of the engine's answer (``usage``, vLLM's ``metrics``,
llama.cpp's ``timings``, TensorFold's ``tensorfold``) or CapyCTL's own clock
(the router). A figure nobody measured is left out, never shown as 0; an
engine's 0.0 timing placeholder counts as "not measured".

Router definitions: ``ttft_ms`` runs from sending the request to the engine
to the first chunk with generated text (answer or reasoning);
``decode_tokens_per_second`` is the completion tokens after the first over
the time from that first text to the last chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from capyctl.domain.engines import EngineFamily, version_key

FIGURES = ("ttft_ms", "queue_ms", "prefill_ms", "decode_tokens_per_second", "cached_tokens")
Seen = dict[str, Any]  # the engine objects seen on the stream: usage, metrics, timings, tensorfold
Rule = Callable[[Seen], float | None]


def _get(seen: Seen, path: tuple[str, ...]) -> Any:
    value: Any = seen
    for part in path:
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def _path(dotted: str) -> tuple[str, ...]:
    """``usage.prompt_tokens``, split once, when the rule is made (a rule runs once per answer)."""
    return tuple(dotted.split("."))


def _timing(value: Any) -> float | None:
    """A timing figure; 0 and non-numbers mean the engine did not measure it."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        return None
    return float(value)


def field(path: str) -> Rule:
    parts = _path(path)
    return lambda seen: _timing(_get(seen, parts))


def count(path: str) -> Rule:
    parts = _path(path)

    def rule(seen: Seen) -> float | None:
        value = _get(seen, parts)
        return None if isinstance(value, bool) or not isinstance(value, int) else value

    return rule


def total(*paths: str) -> Rule:
    split = [_path(path) for path in paths]

    def rule(seen: Seen) -> float | None:
        parts = [_timing(_get(seen, path)) for path in split]
        known = [part for part in parts if part is not None]
        return None if len(known) < len(parts) else sum(known)

    return rule


def per_second(path: str) -> Rule:
    """A rate from a mean interval in milliseconds (vLLM's mean time between tokens)."""
    parts = _path(path)

    def rule(seen: Seen) -> float | None:
        interval = _timing(_get(seen, parts))
        return None if interval is None else 1000.0 / interval

    return rule


ROUTER = None  # the figure is measured by CapyCTL


class MetricsRow(msgspec.Struct, frozen=True, kw_only=True):
    family: EngineFamily
    low: tuple[int, ...]
    high: tuple[int, ...]
    # figure -> (engine rule or None, router fallback allowed); a figure absent here is never reported
    figures: dict[str, tuple[Rule | None, bool]]
    note: str

    def contains(self, key: tuple[int, ...]) -> bool:
        return self.low <= key[: len(self.low)] and key[: len(self.high)] <= self.high


F = EngineFamily
CACHED = count("usage.prompt_tokens_details.cached_tokens")
_COMPLETION_TOKENS = count("usage.completion_tokens")
METRICS_TABLE: tuple[MetricsRow, ...] = (
    MetricsRow(
        family=F.VLLM,
        low=(0, 29),
        high=(0, 33),
        note="vLLM per-request `metrics` (--enable-per-request-metrics)",
        figures={
            "ttft_ms": (total("metrics.queue_time_ms", "metrics.time_to_first_token_ms"), True),
            "queue_ms": (field("metrics.queue_time_ms"), False),
            "prefill_ms": (field("metrics.time_to_first_token_ms"), False),
            "decode_tokens_per_second": (per_second("metrics.mean_itl_ms"), True),
            "cached_tokens": (CACHED, False),
        },
    ),
    MetricsRow(
        family=F.SGLANG,
        low=(0, 5, 18),
        high=(0, 5, 23),
        note="SGLang streams carry no timings",
        figures={
            "ttft_ms": (ROUTER, True),
            "decode_tokens_per_second": (ROUTER, True),
            "cached_tokens": (CACHED, False),
        },
    ),
    MetricsRow(
        family=F.TENSORFOLD,
        low=(0, 6),
        high=(0, 6),
        note="TensorFold `tensorfold` statistics on the finish chunk (0.6.x field names unverified)",
        figures={
            "ttft_ms": (field("tensorfold.ttft_ms"), True),
            "prefill_ms": (field("tensorfold.prefill_ms"), False),
            "decode_tokens_per_second": (field("tensorfold.decode_tokens_per_second"), True),
            "cached_tokens": (CACHED, False),
        },
    ),
    MetricsRow(
        family=F.LLAMACPP,
        low=(0, 6, 0),
        high=(0, 6, 0),
        note="llama.cpp `timings` on the last chunk",
        figures={
            "ttft_ms": (ROUTER, True),
            "prefill_ms": (field("timings.prompt_ms"), False),
            "decode_tokens_per_second": (field("timings.predicted_per_second"), True),
            "cached_tokens": (CACHED, False),
        },
    ),
)


def metrics_row_for(family: EngineFamily | str, version: str) -> MetricsRow:
    """The row for ``family`` at ``version``; outside every range, the nearest lower (or lowest) row."""
    rows = [r for r in METRICS_TABLE if r.family == family]
    key = version_key(version)
    for row in rows:
        if row.contains(key):
            return row
    lower = [r for r in rows if r.high < key[: len(r.high)]]
    return lower[-1] if lower else rows[0]


ENGINE_OBJECTS = frozenset({"usage", "metrics", "timings", "tensorfold"})


class Meter:
    """The engine's own figures and CapyCTL's timing of one stream, as the relay check notes them.

    The times are the ``Clock`` port's monotonic seconds: the check reads the
    clock once per network read, and once more for the chunks after the
    first one with text (``relay_check.StreamCheck``).
    """

    __slots__ = ("_now", "sent_at", "first_text_at", "last_at", "text_chunks", "seen")

    def __init__(self, now: Callable[[], float]) -> None:
        self._now = now
        self.sent_at = now()
        self.first_text_at: float | None = None
        self.last_at: float | None = None
        self.text_chunks = 0
        self.seen: Seen = {}

    def router_ttft_ms(self) -> float | None:
        return None if self.first_text_at is None else (self.first_text_at - self.sent_at) * 1000

    def router_decode_rate(self) -> float | None:
        if self.first_text_at is None or self.last_at is None:
            return None
        tokens = _COMPLETION_TOKENS(self.seen)
        tokens = self.text_chunks if tokens is None else tokens
        elapsed = self.last_at - self.first_text_at
        return (tokens - 1) / elapsed if tokens > 1 and elapsed > 0 else None

    def figures(self, row: MetricsRow) -> dict[str, dict[str, Any]]:
        router = {"ttft_ms": self.router_ttft_ms, "decode_tokens_per_second": self.router_decode_rate}
        out: dict[str, dict[str, Any]] = {}
        for figure in FIGURES:
            if figure not in row.figures:
                continue
            rule, router_fallback = row.figures[figure]
            value = rule(self.seen) if rule is not None else None
            if value is not None:
                out[figure] = {"value": _round(value), "source": "engine"}
            elif router_fallback and figure in router and (mine := router[figure]()) is not None:
                out[figure] = {"value": _round(mine), "source": "router"}
        return dict(sorted(out.items()))


def _round(value: float) -> float | int:
    return value if isinstance(value, int) else round(value, 2)
