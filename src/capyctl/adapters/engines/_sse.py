"""Incremental Server-Sent Events parser for engine streams: ``feed(read)`` gives the read's events.

Bytes arrive cut anywhere (inside a line, inside a UTF-8 character); events
end at a blank line. The ``data:`` payloads of one read come as one
``Chunks`` (their SSE bytes), a payload of several lines in a ``Chunks`` of
its own; ``data: [DONE]`` is ``DONE``; comment lines (``:`` keep-alives) are
a ``Comment``. Nothing is decoded here: the relay check reads the payloads.

A read of whole plain events (``data: {...}``, one line each, LF line ends,
nothing held from before), which is every read of an engine streaming at
its pace and most at full speed, is handed on as it came, with the C scan's
facts (a ``ScanFacts``) when the package was built with it
(``_speedups/scan.c``). Any other read takes the general way, which gives
the same events.

The parser is linear in the bytes it reads: an event that spans many reads
is kept as a list of pieces, only the new bytes are searched for its end,
and an event that grows past ``max_event`` bytes is refused (``EdgeError``)
instead of being buffered without limit.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

from capyctl.domain.errors import EdgeError
from capyctl.domain.relay_check import DELTA_KEYS, OBJECT_NAMES
from capyctl.domain.streams import DONE, Chunks, Comment, ScanFacts, StreamEvent, sse_of

try:  # the scan in C, built with the package where a compiler was found; the check decodes without it
    from capyctl._speedups import scan as _built

    _c_scan: ModuleType | None = _built
except ImportError:  # pragma: no cover - a build without a C compiler
    _c_scan = None

# The C scan's scan_run where it was built, else None (its Python reference, ``_speedups.scan_reference``, gives
# the same facts, slower than the check decodes a read: the parser runs it only when handed it, in the tests)
scan_run: Callable[[bytes, tuple[str, ...], tuple[str, ...]], ScanFacts | None] | None = (
    _c_scan.scan_run if _c_scan is not None else None
)
DEFAULT_MAX_EVENT = 4 * 1024 * 1024
_DONE = b"[DONE]"
_DONE_EVENT = b"data: [DONE]\n\n"


def _payload(block: bytes) -> bytes | None:
    data: list[bytes] = []
    for line in block.split(b"\n"):
        if line.startswith(b"data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(b" ") else value)
    return b"\n".join(data) if data else None


class SseParser:
    """``scan``: True, the C scan where it was built; False, none (the check decodes every read: the way of a
    build without a C compiler); or a scan module of one's own (``scan_run`` and ``respell``: the tests hand
    the Python reference, ``_speedups.scan_reference``)."""

    __slots__ = ("_pending", "_size", "_cr", "_max", "_scan", "_respell", "failed")

    def __init__(self, max_event: int = DEFAULT_MAX_EVENT, scan: bool | ModuleType = True) -> None:
        self._pending: list[bytes] = []  # the start of an event whose end has not arrived
        self._size = 0
        self._cr = False  # the last read ended on a CR whose LF may be next
        self._max = max_event
        scanner = (_c_scan if scan else None) if isinstance(scan, bool) else scan
        self._scan = scanner.scan_run if scanner is not None else None
        self._respell = scanner.respell if scanner is not None else None
        self.failed: EdgeError | None = None  # an event past the limit: feed gave those before it; raised next

    def feed(self, data: bytes) -> list[StreamEvent]:
        """The events whose end came in ``data``, in order; what follows the last one is held for the next.
        Raises ``EdgeError`` for an event past the limit, once the events before it were given."""
        if self.failed is not None:
            raise self.failed
        if not self._pending and not self._cr and data.startswith(b"data: {") and data.endswith(b"\n\n"):
            plain = self._plain(data)
            if plain is not None:
                return plain
        if self._cr:
            data, self._cr = b"\r" + data, False
        if 13 in data:  # CRLF or lone CR line ends (13: CR): normalise, holding back a CR whose LF may be next
            if data.endswith(b"\r"):
                data, self._cr = data[:-1], True
            data = data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        if not data:
            return []
        blocks: list[bytes] = []
        try:
            self._split(data, blocks)
        except EdgeError as error:  # an event past the limit: those before it still go out, then the error
            if not blocks:
                raise
            self.failed = error
        return _events(blocks)

    def _split(self, data: bytes, blocks: list[bytes]) -> None:
        """The whole events of ``data`` (LF line ends) appended to ``blocks``, each checked against the limit
        before it is; what follows the last is held."""
        if self._pending:  # an event is under way: look for its end only around and after the seam
            seam = self._pending[-1].endswith(b"\n")
            if seam and data.startswith(b"\n"):  # the blank line straddles the seam
                block = b"".join(self._pending)[:-1]
                data = data[1:]
            else:
                end = data.find(b"\n\n")
                if end == -1:
                    self._hold(data)
                    return
                block = b"".join(self._pending) + data[:end]
                data = data[end + 2 :]
            self._pending, self._size = [], 0
            self._check(len(block))
            blocks.append(block)
        start = 0
        while (end := data.find(b"\n\n", start)) != -1:
            if end - start > self._max:
                self._check(end - start)
            blocks.append(data[start:end])
            start = end + 2
        if start < len(data):
            self._hold(data[start:] if start else data)

    def _plain(self, data: bytes) -> list[StreamEvent] | None:
        """``feed``'s events for a read of whole plain events (``[DONE]`` may end it); None for any other."""
        body = data
        done = False
        if data.endswith(_DONE_EVENT):
            body = data[: -len(_DONE_EVENT)]
            if not body.endswith(b"\n\n"):
                return None
            done = True
        if len(body) > self._max or 13 in body:
            return None
        scan = self._scan
        if scan is not None:
            facts = scan(body, OBJECT_NAMES, DELTA_KEYS)
            if facts is None:
                return None
            chunks = Chunks(body, None, facts, self._respell)
        elif body.find(b"\n") == len(body) - 2:  # one event: its only LF is the first of its blank line
            chunks = Chunks(body, [body[6:-2]])
        else:
            payloads = body[6:-2].split(b"\n\ndata: ")
            if 10 in b"".join(payloads) or _DONE in payloads:  # a payload of several lines, an event that
                return None  # is no data line, or a [DONE] that events follow: the general way's
            chunks = Chunks(body, payloads)
        return [chunks, DONE] if done else [chunks]

    def _hold(self, piece: bytes) -> None:
        self._pending.append(piece)
        self._size += len(piece)
        self._check(self._size - (piece[-1] == 10))  # (a last LF may begin the blank line: not the event's)

    def _check(self, size: int) -> None:
        if size > self._max:
            self._pending, self._size = [], 0
            raise EdgeError(f"the engine sent an event larger than the limit of {self._max} bytes")

    def close(self) -> list[StreamEvent]:
        """A last event the engine did not end with a blank line."""
        if self.failed is not None:
            raise self.failed
        block = b"".join(self._pending).strip(b"\n")
        self._pending, self._size = [], 0
        return _events([block]) if block else []


def _events(blocks: list[bytes]) -> list[StreamEvent]:
    """The events of whole blocks (each without its blank line): one-line payloads in a row make one Chunks."""
    events: list[StreamEvent] = []
    payloads: list[bytes] = []
    for block in blocks:
        if block.startswith(b"\n"):  # a stray LF before the event
            block = block.lstrip(b"\n")
        if block.startswith(b"data: ") and 10 not in block:  # the common case (10 as an int is a memchr)
            payload: bytes | None = block[6:]
        else:
            payload = _payload(block)
        if payload is None:
            if block.startswith(b":"):
                if payloads:
                    events.append(Chunks(b"data: " + b"\n\ndata: ".join(payloads) + b"\n\n", payloads))
                    payloads = []
                events.append(Comment(block))
            continue
        if payload == _DONE or 10 in payload:
            if payloads:
                events.append(Chunks(b"data: " + b"\n\ndata: ".join(payloads) + b"\n\n", payloads))
                payloads = []
            events.append(DONE if payload == _DONE else Chunks(sse_of([payload]), [payload]))
            continue
        payloads.append(payload)
    if payloads:
        events.append(Chunks(b"data: " + b"\n\ndata: ".join(payloads) + b"\n\n", payloads))
    return events
