"""A ``RequestStore`` in memory, following the domain's own rules; it can be made slow or failing."""

from __future__ import annotations

import threading

from capyctl.domain.request_rows import Entry, RequestRow, Retention, RowFilter, Settle, pick, retained, settled


class FakeRequestStore:
    def __init__(self) -> None:
        self.rows: list[RequestRow] = []  # in the order written
        self.writes: list[list[Entry]] = []  # each batch, as given
        self.write_threads: list[str] = []
        self.prunes: list[tuple[Retention, float]] = []
        self.fail = False  # add_requests raises while set
        self.gate = threading.Event()  # add_requests waits for it (a slow disk) ...
        self.gate.set()  # ... unless cleared
        self.entered = threading.Event()  # set once a write has begun

    def add_requests(self, entries: list[Entry]) -> None:
        self.entered.set()
        self.gate.wait(30)
        self.write_threads.append(threading.current_thread().name)
        if self.fail:
            raise OSError("disk full")
        self.writes.append(list(entries))
        for entry in entries:
            if isinstance(entry, Settle):
                self.rows = [settled(r, entry) if r.id == entry.id else r for r in self.rows]
            elif all(r.id != entry.id for r in self.rows):
                self.rows.append(entry)

    def prune_requests(self, retention: Retention, now: float) -> None:
        self.prunes.append((retention, now))
        self.rows = retained(self.rows, now, retention)

    def list_requests(self, where: RowFilter) -> list[RequestRow]:
        return pick(self.rows, where)

    def get_request(self, request_id: str) -> RequestRow | None:
        return next((r for r in self.rows if r.id == request_id), None)
