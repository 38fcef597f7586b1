"""Log output: text lines for people, or one JSON object a line (``--log-format json``)."""

from __future__ import annotations

import functools
import logging
import os
import select
import stat
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any, TextIO

import msgspec

_STANDARD = set(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, and the record's structured fields."""

    def format(self, record: logging.LogRecord) -> str:
        entry = _entry(record.created, record.msecs, record.levelname.lower(), record.name, record.getMessage())
        fields = {key: value for key, value in record.__dict__.items() if key not in _STANDARD}
        if record.exc_info:
            return _json_line(entry, fields, self.formatException(record.exc_info))
        return _json_line(entry, fields)

    def routine(self, created: float, name: str, message: str, args: tuple[Any, ...], extra: dict[str, Any]) -> str:
        """``format(_routine_record(created, name, message, args, extra))``, without making the record: the
        same text, for the line every request gets (``extra`` names no attribute of a record)."""
        entry = _entry(created, (created - int(created)) * 1000, "info", name, _message(message, args))
        return _json_line(entry, extra)


def _entry(created: float, msecs: float, level: str, name: str, message: str) -> dict[str, Any]:
    """A JSON line's first fields: its time (UTC, to the millisecond), level, logger and message."""
    return {
        "time": f"{_utc_second(int(created))}.{int(msecs):03d}Z",
        "level": level,
        "logger": name,
        "message": message,
    }


def _json_line(entry: dict[str, Any], fields: dict[str, Any], exception: str | None = None) -> str:
    """``entry`` with the structured ``fields`` (those not starting with ``_``), then the exception, as JSON."""
    for key, value in fields.items():
        if not key.startswith("_"):
            entry[key] = value
    if exception is not None:
        entry["exception"] = exception
    return msgspec.json.encode(entry, enc_hook=str).decode()


class TextFormatter(logging.Formatter):
    """``%(asctime)s %(message)s`` with the time of day: the text lines, for people."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(message)s", datefmt="%H:%M:%S")

    def routine(self, created: float, name: str, message: str, args: tuple[Any, ...], extra: dict[str, Any]) -> str:
        """``format(_routine_record(...))`` without making the record (see ``JsonFormatter.routine``)."""
        if self.converter is not time.localtime or self.datefmt != "%H:%M:%S" or self._fmt != "%(asctime)s %(message)s":
            return self.format(_routine_record(created, name, message, args, extra))
        return f"{_local_second(int(created))} {_message(message, args)}"


def _message(message: str, args: tuple[Any, ...]) -> str:
    """``LogRecord.getMessage`` for a record made with these (a lone non-empty mapping is the mapping)."""
    if not args:
        return str(message)
    if len(args) == 1 and isinstance(args[0], Mapping) and args[0]:
        return str(message) % args[0]
    return str(message) % args


@functools.lru_cache(maxsize=4)
def _utc_second(second: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))


@functools.lru_cache(maxsize=4)
def _local_second(second: int) -> str:
    return time.strftime("%H:%M:%S", time.localtime(second))


class BatchedWriter(logging.Handler):
    """Log lines written to a stream by a thread of its own, in batches.

    The event loop only appends the record (its message formatted at once, so that it says what was true
    then). A routine line (a record with ``_routine`` set: the one line each request gets) waits for the
    writer thread's next round, every ``every`` seconds, where all pending lines leave in one write: a
    wake per line, as a queue would do, cost the relay a thread switch per request. ``due()``, called as a
    request's answer is about to end, writes the routine lines still waiting from the caller's own thread
    when the stream takes them without blocking (a regular file; a pipe, socket or terminal that polls
    writable, for at most ``PIPE_BUF`` bytes), and wakes the writer for them otherwise: a request's line is
    out before its client has the whole answer, at no cost to the first token and without a thread switch
    per request (a wake of the writer was about 25 µs more CPU a request at 32 streams). Any other line
    wakes the writer at once.
    ``stop()`` writes the last lines. Lines leave in the order they were logged, whichever thread writes.
    """

    def __init__(self, stream: TextIO, every: float = 0.05) -> None:
        super().__init__()
        self._stream = stream
        self._every = every
        self._records: deque[logging.LogRecord | tuple[float, str, Callable[..., Any], tuple[Any, ...]]] = deque()
        self._stop = False
        self._due = False  # routine lines wait for a round (set after appending, cleared before writing)
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="capyctl-log", daemon=True)
        self._writing = threading.Lock()  # one thread at a time takes lines and writes them: their order holds
        self._carry = ""  # lines made by due() that were too long to write then: the writer's next write
        self._takes_now, self._any_size = _takes_now(stream)

    def handle(self, record: logging.LogRecord) -> bool:  # no lock: deque.append is atomic
        if not self.filter(record):
            return False
        try:
            record.msg, record.args = record.getMessage(), None
        except Exception:  # a wrong format string: said on stderr, as logging does
            self.handleError(record)
            return False
        self._records.append(record)
        if getattr(record, "_routine", False):
            self._due = True
        else:
            self._wake.set()
        return True

    def emit(self, record: logging.LogRecord) -> None:
        self.handle(record)

    def routine(
        self,
        logger: logging.Logger,
        line: Callable[..., tuple[str, tuple[Any, ...], dict[str, Any]]],
        values: tuple[Any, ...],
    ) -> bool:
        """A routine INFO line of ``logger``, queued as ``line`` and its ``values`` without making anything
        now: the writer calls ``line(*values)`` (its format, arguments and fields) in its round and makes
        the record the logger would have made (time included). False, with nothing queued, when the line
        could go anywhere else than here (another handler, a filter, a level or a disabled logger on its
        way): the caller then logs it the usual way."""
        if self.filters or self.level > logging.INFO or logging.root.handlers != [self]:
            return False
        if not logger.isEnabledFor(logging.INFO):
            return False
        step: logging.Logger | None = logger
        while step is not None and step.parent is not None:  # up to the root, which holds only this
            if step.handlers or step.filters or step.disabled or not step.propagate:
                return False
            step = step.parent
        self._records.append((time.time(), logger.name, line, values))
        self._due = True
        return True

    def due(self) -> None:
        """Write the routine lines still waiting, now, from this thread if the stream takes them without
        blocking; else (or while the writer is writing) wake the writer for them."""
        if not self._due:
            return
        if self._takes_now is None or not self._writing.acquire(blocking=False):
            self._wake.set()
            return
        try:
            if not self._takes_now():
                self._wake.set()
                return
            text = self._take()
            if not (self._any_size or len(text) <= _PIPE_BUF // 4 or len(text.encode()) <= _PIPE_BUF):
                self._carry = text  # more than a pipe takes in one piece: left to the writer thread
                self._wake.set()
                return
            self._write(text)
        finally:
            self._writing.release()

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            self._wake.wait(self._every)
            self._wake.clear()  # what was appended before this is written now, by the flush below
            self.flush()

    def flush(self) -> None:
        with self._writing:
            self._write(self._take())

    def _take(self) -> str:
        """Every pending line, formatted, as one text (empty: none); called holding ``_writing``."""
        lines = [self._carry] if self._carry else []
        self._carry = ""
        records = self._records
        routine = getattr(self.formatter, "routine", None)  # a formatter of this module's: no record needed
        self._due = False  # what is appended from here on sets it again
        while records:
            record = records.popleft()
            if isinstance(record, tuple):
                created, name, line, values = record
                try:
                    message, args, extra = line(*values)
                except Exception:  # a broken line function: said on stderr, as logging says a bad format
                    self.handleError(_routine_record(created, name, repr(line), (), {}))
                    continue
                if routine is not None and _STANDARD.isdisjoint(extra):
                    try:
                        lines.append(routine(created, name, message, args, extra) + "\n")
                        continue
                    except Exception:  # (a bad format: the usual way below says so on stderr)
                        pass
                record = _routine_record(created, name, message, args, extra)
            try:
                lines.append(self.format(record) + "\n")
            except Exception:
                self.handleError(record)
        return "".join(lines)

    def _write(self, text: str) -> None:
        if text:
            try:
                self._stream.write(text)
                self._stream.flush()
            except (OSError, ValueError):  # stderr closed or full: the lines are lost, the server goes on
                pass

    def stop(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join()
        self.flush()


_PIPE_BUF = select.PIPE_BUF  # a write of at most this much to a pipe that polls writable does not block


def _takes_now(stream: TextIO) -> tuple[Callable[[], bool] | None, bool]:
    """(whether a write to ``stream``'s file cannot block now, whether that holds for a write of any size):
    a regular file takes any write; a pipe, socket or terminal takes one of up to PIPE_BUF bytes while it
    polls writable. (None, False) for a stream without a file of its own: the writer thread writes to it."""
    try:
        fd = stream.fileno()
        mode = os.fstat(fd).st_mode
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return None, False
    if stat.S_ISREG(mode):
        return (lambda: True), True
    poll = select.poll()
    poll.register(fd, select.POLLOUT)
    return (lambda: bool(poll.poll(0))), False


def _routine_record(
    created: float, name: str, message: str, args: tuple[Any, ...], extra: dict[str, Any]
) -> logging.LogRecord:
    """The record ``logging`` would have made for a routine line at ``created`` (no caller's frame: see
    configure_logging)."""
    record = logging.LogRecord(
        name, logging.INFO, "(unknown file)", 0, message, args or None, None, "(unknown function)"
    )
    record.relativeCreated -= (record.created - created) * 1000
    record.created = created
    record.msecs = int((created - int(created)) * 1000) + 0.0
    record.__dict__.update(extra)
    return record


_active: BatchedWriter | None = None


def routine_line(
    logger: logging.Logger, line: Callable[..., tuple[str, tuple[Any, ...], dict[str, Any]]], values: tuple[Any, ...]
) -> None:
    """A routine line to the writer ``configure_logging`` set up (``BatchedWriter.routine``), or the usual
    way where that writer is not the only way out for it."""
    if _active is None or not _active.routine(logger, line, values):
        message, args, extra = line(*values)
        logger.info(message, *args, extra=extra)


def routine_due() -> None:
    """``BatchedWriter.due`` of the writer ``configure_logging`` set up, if any."""
    if _active is not None:
        _active.due()


def configure_logging(log_format: str = "text") -> BatchedWriter:
    """Log to stderr from a thread of its own (a write to stderr costs the event loop ~40 µs a line), in
    batches a few times a second.

    Returns the writer; ``stop()`` it at exit to write what is pending.
    """
    handler = BatchedWriter(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(TextFormatter())
    # No line says where in the source it was logged, nor by which thread or process: without these
    # lookups (a walk up the stack for the caller, above all) a record costs a few µs less to make.
    logging._srcfile = None  # the documented way to skip the caller's frame lookup
    logging.logThreads = logging.logProcesses = logging.logMultiprocessing = False
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    handler.start()
    global _active
    _active = handler
    return handler
