"""Live pages: one server-sent-event stream per open page, carrying the fragments that changed.

Nothing here sits on a request's path. Each stored event (a state change, a
park, a switch ...) pokes the ``Hub``, which only sets a mark on each open
stream (``Feed``): a constant-time call per stream that never waits, whatever
the browsers do. Each stream is its own task:

1. on open, it sends every fragment of its page (so a page that lost its
   stream catches up as soon as the browser reconnects);
2. then it waits for a mark or ``TICK`` seconds (queues, elapsed times and
   request records change without an event), reads the page's data again
   and sends the fragments whose data changed, rendered afresh.

A stream's queue is bounded at one mark: any number of changes while the
stream is busy, or while its browser does not read, collapse into that one
mark, and the stream then sends the state as it is now (drop and resync).
A stalled browser therefore holds back only its own task, at the socket's
write buffer; it holds no backlog and delays no one else. Streams end when
the session ends, when the server stops, or past ``MAX_STREAMS`` (refused).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any

import anyio
from litestar.response import ServerSentEventMessage

TICK = 0.5  # seconds between two looks at what changes without an event (queues, elapsed times)
MAX_STREAMS = 64  # open streams at most, over all sessions
RETRY_MS = 1000  # how soon a browser reconnects after the stream dropped


class Feed:
    """One open stream's mark: set by the hub, taken by the stream."""

    __slots__ = ("_mark",)

    def __init__(self) -> None:
        self._mark = anyio.Event()

    def offer(self) -> None:
        self._mark.set()

    async def wait(self, timeout: float) -> None:
        with anyio.move_on_after(timeout):
            await self._mark.wait()
        if self._mark.is_set():
            self._mark = anyio.Event()


class Hub:
    """Fans 'something changed' out to the open streams; notes when each deployment's state began."""

    def __init__(self, wall: Callable[[], float]) -> None:
        self._wall = wall
        self._feeds: set[Feed] = set()
        self.version = 0  # counts the events seen: a page whose data only events change reads it again when it moves
        self.since: dict[str, tuple[str, float]] = {}  # deployment -> (state, wall time it began)

    def event(self, deployment: str | None, kind: str, detail: dict[str, Any]) -> None:
        """An ``Events`` listener: called in the emitter's turn, so it only notes and marks."""
        self.version += 1
        if kind == "state_changed" and deployment is not None:
            self.since[deployment] = (str(detail.get("state")), self._wall())
        elif kind == "deployment_deleted" and deployment is not None:
            self.since.pop(deployment, None)
        for feed in self._feeds:
            feed.offer()

    @property
    def streams(self) -> int:
        return len(self._feeds)

    @contextmanager
    def feed(self) -> Iterator[Feed]:
        feed = Feed()
        self._feeds.add(feed)
        try:
            yield feed
        finally:
            self._feeds.discard(feed)


Snapshot = dict[str, Any]  # fragment name -> the data it shows


async def stream(
    feed: Feed,
    snapshot: Callable[[], Snapshot | Awaitable[Snapshot]],
    render: Callable[[str, Snapshot], str],
    alive: Callable[[], bool],
    stopping: anyio.Event,
) -> AsyncIterator[ServerSentEventMessage]:
    """The messages of one page's stream: everything first, then what changed, until ``alive`` says no or
    the server stops (then a ``signed-out`` or ``closing`` message, and the end)."""
    sent: Snapshot = {}
    yield ServerSentEventMessage(comment="capyctl dashboard", data=None, retry=RETRY_MS)
    while True:
        if not alive():
            yield ServerSentEventMessage(event="signed-out", data="signed out")
            return
        now = snapshot()
        if not isinstance(now, dict):  # a page whose data is read off the loop (the request records)
            now = await now
        for name, data in now.items():
            if name not in sent or sent[name] != data:
                yield ServerSentEventMessage(event=name, data=render(name, now))
        sent = now
        if stopping.is_set():
            yield ServerSentEventMessage(event="closing", data="server stopping")
            return
        await feed.wait(TICK)
