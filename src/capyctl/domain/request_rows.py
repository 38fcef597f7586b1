"""Request records: one row per finished or refused inference request, kept for a while.

A row is written once the request's outcome is known, never while it runs:
the front door builds it and appends it to a ``RowBuffer`` (bounded, O(1),
no I/O), and a task of the server writes what is buffered to the store in
batches. When the buffer is full the row is dropped and counted rather than
waiting: a slow store must never slow a request.

The figures use the vocabulary the answers already carry (``capyctl.metrics``:
``ttft_ms``, ``queue_ms``, ``prefill_ms``, ``decode_tokens_per_second``,
``cached_tokens``; the engine's ``usage``: ``prompt_tokens``,
``completion_tokens``) plus CapyCTL's own wait in line for its deployment
(``queue_wait_ms``, Prometheus' ``capyctl_queue_wait_seconds``). A figure
nobody measured is None, never 0. A row names the API key by its name and
never holds the caller's ``X-Request-Id``.

A cut request may be settled later (``domain/settlement``): its row names the
rule at once, and a ``Settle`` fills in the seconds once evidence came.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Mapping, Sequence

import msgspec

from capyctl.domain.errors import InvalidConfig, InvalidRequest
from capyctl.domain.units import parse_duration

MAX_NAME = 200  # characters of a deployment name kept: an unknown name is the client's text, of any length
LIMIT_DEFAULT = 100  # rows a listing gives unless told
LIMIT_MOST = 1000  # rows a listing gives at most


class RequestRow(msgspec.Struct, frozen=True, kw_only=True):
    """One finished or refused request, as stored (times are wall-clock seconds, durations milliseconds)."""

    id: str  # CapyCTL's own request ID (the X-CapyCTL-Request-Id answered)
    at: float  # when its answer ended (or it was refused)
    api: str  # "chat" or "decisions"
    code: str  # "ok", or the error code the client got
    status: int | None = None  # the HTTP status sent; a stream that began is 200 even if it ended on an error
    deployment: str | None = None  # the model named (None when refused before CapyCTL read it)
    key: str | None = None  # the API key's name, never its secret (None when refused before the key was known)
    instance: int | None = None  # the instance the engine call went to; None when no engine saw it
    stream: bool = False
    total_ms: float | None = None  # from its last byte in to the end of its answer
    queue_wait_ms: float | None = None  # CapyCTL's wait in line for its deployment (start, wake, a free slot)
    ttft_ms: float | None = None
    queue_ms: float | None = None  # the engine's own queue time, where the engine reports it
    prefill_ms: float | None = None
    decode_tokens_per_second: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    cause: str | None = None  # why it was cut (client_gone, deadline, stream_idle ...), when it was
    settlement: str | None = None  # the rule that settles a cut request (engine_idle, engine_stop)
    settled_s: float | None = None  # seconds from the cut to the evidence that settled it; None while unsettled


class Settle(msgspec.Struct, frozen=True):
    """A cut request settled: the update its row gets."""

    id: str
    rule: str
    seconds: float


Entry = RequestRow | Settle


class RowBuffer:
    """Rows (and settlements) waiting for the store, at most ``bound``: past it, ``add`` drops and counts.

    Used from one thread (the event loop's): ``add`` on the request's path, ``take`` by the writing task.
    """

    __slots__ = ("bound", "dropped", "_items")

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.dropped = 0  # entries refused because the buffer was full, since the start
        self._items: collections.deque[Entry] = collections.deque()

    def add(self, entry: Entry) -> bool:
        """Keep ``entry`` for the store; False (and counted in ``dropped``) when the buffer is full."""
        if len(self._items) >= self.bound:
            self.dropped += 1
            return False
        self._items.append(entry)
        return True

    def take(self, most: int) -> list[Entry]:
        """Up to ``most`` entries, oldest first, taken out of the buffer."""
        items = self._items
        return [items.popleft() for _ in range(min(most, len(items)))]

    def __len__(self) -> int:
        return len(self._items)


class Retention(msgspec.Struct, frozen=True, kw_only=True):
    """How many rows are kept, and for how long: the newest ``max_count`` younger than ``max_age`` seconds."""

    max_count: int = 100_000
    max_age: float = 7 * 86400.0

    def oldest_kept(self, now: float) -> float:
        """Rows that ended before this wall time are gone."""
        return now - self.max_age


class RecordSettings(msgspec.Struct, frozen=True, kw_only=True):
    """How the server keeps its request records (the file's ``records`` section, in seconds)."""

    retention: Retention = Retention()
    buffer: int = 10_000  # entries waiting for the store at most; past it they are dropped and counted
    flush_every: float = 0.5  # seconds between two writes of the buffer
    batch: int = 2000  # entries in one write
    prune_every: float = 60.0  # seconds between two retention passes


def retained(rows: Sequence[RequestRow], now: float, retention: Retention) -> list[RequestRow]:
    """The rules of ``Retention`` over ``rows`` in the order they were written: what a store keeps."""
    young = [row for row in rows if row.at >= retention.oldest_kept(now)]
    return young[-retention.max_count :] if len(young) > retention.max_count else young


def settled(row: RequestRow, settle: Settle) -> RequestRow:
    return msgspec.structs.replace(row, settlement=settle.rule, settled_s=round(settle.seconds, 3))


class RowFilter(msgspec.Struct, frozen=True, kw_only=True):
    """Which rows a listing gives: every field set must match; newest first, at most ``limit``."""

    deployment: str | None = None
    key: str | None = None
    code: str | None = None
    status: int | None = None
    since: float | None = None  # wall time: rows that ended at or after it
    limit: int = LIMIT_DEFAULT

    def matches(self, row: RequestRow) -> bool:
        return (
            (self.deployment is None or row.deployment == self.deployment)
            and (self.key is None or row.key == self.key)
            and (self.code is None or row.code == self.code)
            and (self.status is None or row.status == self.status)
            and (self.since is None or row.at >= self.since)
        )


def pick(rows: Iterable[RequestRow], where: RowFilter) -> list[RequestRow]:
    """``where`` applied to ``rows`` (in the order they were written): newest first, at most ``limit``."""
    return [row for row in reversed(list(rows)) if where.matches(row)][: where.limit]


_FILTER_PARAMS = ("deployment", "key", "code", "status", "since", "limit")


def read_filter(params: Mapping[str, str], now: float) -> RowFilter:
    """A listing's query parameters as a filter; raises ``InvalidRequest`` naming the parameter at fault.

    ``since`` is a duration back from ``now`` (``10m``, ``90s``, ``1h`` or seconds); ``status`` an HTTP
    status; ``limit`` 1 to 1000.
    """
    for name in params:
        if name not in _FILTER_PARAMS:
            raise InvalidRequest(f"{name!r} is not a filter of requests; use {', '.join(_FILTER_PARAMS)}", param=name)
    for name in ("deployment", "key", "code"):
        if name in params and not params[name]:
            raise InvalidRequest(f"'{name}' must not be empty", param=name)
    status = _whole(params, "status", 100, 599, "an HTTP status from 100 to 599")
    limit = _whole(params, "limit", 1, LIMIT_MOST, f"a whole number from 1 to {LIMIT_MOST}")
    since = None
    if "since" in params:
        try:
            since = now - parse_duration(params["since"], "since")
        except InvalidConfig as error:
            raise InvalidRequest(f"{error.message} (how far back to look)", param="since") from None
    return RowFilter(
        deployment=params.get("deployment"),
        key=params.get("key"),
        code=params.get("code"),
        status=status,
        since=since,
        limit=LIMIT_DEFAULT if limit is None else limit,
    )


def _whole(params: Mapping[str, str], name: str, low: int, high: int, what: str) -> int | None:
    if name not in params:
        return None
    text = params[name].strip()
    if not text.isdigit() or not low <= int(text) <= high:
        raise InvalidRequest(f"'{name}' must be {what}, not {params[name]!r}", param=name)
    return int(text)


def clip_name(name: str) -> str:
    """A deployment name as a row keeps it (an unknown name is the client's text: bounded)."""
    return name if len(name) <= MAX_NAME else name[:MAX_NAME] + "…"
