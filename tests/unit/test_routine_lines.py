"""The routine lane: the one line each request gets leaves exactly as ``log.info`` would have written it, and
only when the writer is the sole way out for it (pytest's caplog, a filter or a level keep the usual way)."""

from __future__ import annotations

import contextlib
import io
import logging
from collections.abc import Iterator

import msgspec

from capyctl.adapters.log_format import BatchedWriter, JsonFormatter, _routine_record

NAME = "capyctl.test.routine"
EXTRA = {"event": "router_selection", "capyctl_request_id": "01ABC", "caller_request_id": None,
         "deployment": "m", "host": "local", "instance": 0, "key": "k", "_routine": True}


@contextlib.contextmanager
def alone() -> Iterator[tuple[BatchedWriter, io.StringIO]]:
    """A writer that is the root's only handler, as ``configure_logging`` leaves it (pytest's own handlers,
    which it puts on the root for each test, are set aside meanwhile)."""
    stream = io.StringIO()
    writer = BatchedWriter(stream, every=3600)
    writer.setFormatter(JsonFormatter())
    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    root.handlers[:] = [writer]
    root.setLevel(logging.INFO)
    try:
        yield writer, stream
    finally:
        root.handlers[:] = saved
        root.setLevel(level)
        logging.getLogger(NAME).disabled = False
        logging.getLogger(NAME).setLevel(logging.NOTSET)


def test_a_routine_line_is_written_as_log_info_writes_it() -> None:
    with alone() as (writer, stream):
        assert writer.routine(NAME, "request 01ABC m -> local instance 0 key k", dict(EXTRA))
        logging.getLogger(NAME).info("request %s %s -> %s instance %d key %s", "01ABC", "m", "local", 0, "k",
                                     extra=dict(EXTRA))
        writer.flush()
    lane, usual = (msgspec.json.decode(line) for line in stream.getvalue().splitlines())
    assert lane.pop("time")[:16] == usual.pop("time")[:16]  # (the same minute: made a moment apart)
    assert lane == usual and lane["message"] == "request 01ABC m -> local instance 0 key k"


def test_a_routine_record_keeps_the_time_it_was_logged_at() -> None:
    record = _routine_record(123.456, NAME, "m", dict(EXTRA))
    assert msgspec.json.decode(JsonFormatter().format(record))["time"] == "1970-01-01T00:02:03.456Z"
    assert logging.Formatter("%(asctime)s").format(record).endswith(",456")


def test_anything_else_on_the_way_takes_the_usual_way() -> None:
    with alone() as (writer, stream):
        root = logging.getLogger()
        other = logging.NullHandler()
        root.addHandler(other)  # as pytest's caplog does
        assert not writer.routine(NAME, "x", dict(EXTRA))
        root.removeHandler(other)
        logging.getLogger(NAME).setLevel(logging.WARNING)
        assert not writer.routine(NAME, "x", dict(EXTRA))
        logging.getLogger(NAME).setLevel(logging.NOTSET)
        logging.getLogger(NAME).disabled = True
        assert not writer.routine(NAME, "x", dict(EXTRA))
        logging.getLogger(NAME).disabled = False
        writer.addFilter(lambda record: False)
        assert not writer.routine(NAME, "x", dict(EXTRA))
        writer.flush()
        assert stream.getvalue() == ""  # nothing was queued by a refusal
        writer.filters.clear()
        assert writer.routine(NAME, "x", dict(EXTRA))  # and alone again, the lane is open
