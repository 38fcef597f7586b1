"""The request records: kept off the requests' path, written by a task of the server, read by the CLI and
the dashboard.

``add`` (called by the front door as a request ends) and ``settle`` (called
as a cut request is settled) only append to a bounded buffer: no I/O, no
lock, no wait. ``run`` takes what is buffered every ``flush_every`` seconds
and writes it to the store on a worker thread, then keeps the store within
its retention. A store that is slow leaves the buffer to fill, and entries
past its bound are dropped and counted; a store that fails loses that batch,
counted too. Either is said in one log line per round, never per request.

A read first writes what was buffered before it, so a client sees the
request it has just made.
"""

from __future__ import annotations

import collections
import logging

import anyio
import anyio.abc

from capyctl.domain.errors import InvalidRequest
from capyctl.domain.ports import Clock, RequestStore
from capyctl.domain.request_charts import RECENT_SECONDS, WINDOWS, Bucket, Recent, chart, recent
from capyctl.domain.request_rows import RecordSettings, RequestRow, RowBuffer, RowFilter, Settle

log = logging.getLogger("capyctl.records")
RECENT_BOUND = 20_000  # rows the Fleet cards' figures are read from at most (the newest)


class RequestLog:
    def __init__(self, store: RequestStore, clock: Clock, settings: RecordSettings = RecordSettings()) -> None:
        self._store = store
        self._clock = clock
        self._settings = settings
        self._buffer = RowBuffer(settings.buffer)
        self._writing = anyio.Lock()
        self.lost = 0  # entries taken from the buffer whose write failed
        self.written = 0  # entries stored since the start: a reader that saw this count has seen them all
        self._dropped_told = 0  # ``dropped`` as the last log line told it
        self._pruned_at = -1e18
        # the stored rows of the last RECENT_SECONDS (the newest RECENT_BOUND of them), and their figures
        self._recent: collections.deque[RequestRow] = collections.deque(maxlen=RECENT_BOUND)
        self._figures: tuple[tuple[int, int], dict[str, Recent]] = ((-1, -1), {})

    @property
    def dropped(self) -> int:
        """Entries refused by the full buffer (``RowBuffer.dropped``)."""
        return self._buffer.dropped

    def wall(self) -> float:
        return self._clock.wall()

    def add(self, row: RequestRow) -> None:
        """A request ended: keep its row for the store (dropped and counted when the buffer is full)."""
        self._buffer.add(row)

    def settle(self, request_id: str, rule: str, seconds: float) -> None:
        """A cut request was settled ``seconds`` after its cut, by ``rule``."""
        self._buffer.add(Settle(request_id, rule, seconds))

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Write the buffer every ``flush_every`` seconds until cancelled; what is left is written on the way out."""
        await self._seed()
        task_status.started()
        try:
            while True:
                await anyio.sleep(self._settings.flush_every)
                await self.flush()
        finally:
            with anyio.CancelScope(shield=True):
                await self.flush()

    async def flush(self) -> None:
        """Write what is buffered now, then prune when it is time; never raises for the store's faults."""
        async with self._writing:
            while len(self._buffer):
                batch = self._buffer.take(self._settings.batch)
                try:
                    await anyio.to_thread.run_sync(self._store.add_requests, batch)
                    self.written += len(batch)
                    self._recent.extend(row for row in batch if isinstance(row, RequestRow))
                except Exception:
                    self.lost += len(batch)
                    log.exception("could not store %d request records (%d lost since the start)", len(batch), self.lost)
                    break
            now = self._clock.monotonic()
            if now - self._pruned_at >= self._settings.prune_every:
                self._pruned_at = now
                try:
                    await anyio.to_thread.run_sync(
                        self._store.prune_requests, self._settings.retention, self._clock.wall()
                    )
                except Exception:
                    log.exception("could not prune the request records")
        if self.dropped != self._dropped_told:
            log.warning(
                "dropped %d request records: the buffer of %d was full (the store is slow or failing); "
                "%d dropped since the start",
                self.dropped - self._dropped_told,
                self._settings.buffer,
                self.dropped,
            )
            self._dropped_told = self.dropped

    async def _seed(self) -> None:
        """The last minutes' rows from the store, so the Fleet cards' figures survive a restart."""
        try:
            rows = await anyio.to_thread.run_sync(
                self._store.list_requests, RowFilter(since=self._clock.wall() - RECENT_SECONDS, limit=RECENT_BOUND)
            )  # the newest, as the window keeps
        except Exception:
            log.exception("could not read the last minutes' request records")
            return
        self._recent.extend(sorted(rows, key=lambda row: row.at))

    def recent(self) -> dict[str, Recent]:
        """Per deployment, its stored answers of the last ``RECENT_SECONDS``: count, TTFT p50, decode p50."""
        now = self._clock.wall()
        while self._recent and self._recent[0].at < now - RECENT_SECONDS:
            self._recent.popleft()
        key = (self.written, int(now))  # read again once rows were stored, or a second later (rows age out)
        if self._figures[0] != key:
            self._figures = (key, recent(self._recent, now))
        return self._figures[1]

    async def find(self, where: RowFilter) -> list[RequestRow]:
        await self.flush()
        return await anyio.to_thread.run_sync(self._store.list_requests, where)

    async def get(self, request_id: str) -> RequestRow | None:
        await self.flush()
        return await anyio.to_thread.run_sync(self._store.get_request, request_id)

    async def chart(self, window: str, deployment: str | None = None) -> dict[str, list[Bucket]]:
        """Per deployment, the buckets of ``window`` (``15m``, ``1h``, ``24h``) up to now."""
        if window not in WINDOWS:
            raise InvalidRequest(f"'window' must be one of {', '.join(WINDOWS)}, not {window!r}", param="window")
        now = self._clock.wall()
        span = WINDOWS[window]
        where = RowFilter(
            deployment=deployment, since=now - span.seconds - span.bucket, limit=self._settings.retention.max_count
        )
        await self.flush()
        # read and bucketed on a worker thread: a day of records is too much work for the requests' loop
        return await anyio.to_thread.run_sync(lambda: chart(self._store.list_requests(where), span, now))
