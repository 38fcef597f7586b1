"""The routine lane: the one line each request gets leaves exactly as ``log.info`` would have written it, and
only when the writer is the sole way out for it (pytest's caplog, a filter or a level keep the usual way); it
waits for the writer's round, or for its answer's end, which sends it on before the answer's last bytes."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from capyctl.adapters import log_format
from capyctl.adapters.http.exchange import Exchange
from capyctl.adapters.log_format import BatchedWriter, JsonFormatter, TextFormatter, _routine_record

NAME = "capyctl.test.routine"
LOGGER = logging.getLogger(NAME)
EXTRA = {
    "event": "router_selection",
    "capyctl_request_id": "01ABC",
    "caller_request_id": None,
    "deployment": "m",
    "host": "local",
    "instance": 0,
    "key": "k",
    "_routine": True,
}


@contextlib.contextmanager
def alone(stream: Any = None) -> Iterator[tuple[BatchedWriter, Any]]:
    """A writer (to ``stream``, a StringIO by default) that is the root's only handler, as
    ``configure_logging`` leaves it (pytest's own handlers, which it puts on the root for each test, are
    set aside meanwhile)."""
    stream = io.StringIO() if stream is None else stream
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


def line(message: str) -> tuple[object, tuple[object, ...]]:
    """(a line function, its values) that make ``message`` (no arguments) with EXTRA's fields."""
    return (lambda text: (text, (), dict(EXTRA))), (message,)


def test_a_routine_line_is_written_as_log_info_writes_it() -> None:
    with alone() as (writer, stream):
        assert writer.routine(LOGGER, *line("request 01ABC m -> local instance 0 key k"))
        logging.getLogger(NAME).info(
            "request %s %s -> %s instance %d key %s", "01ABC", "m", "local", 0, "k", extra=dict(EXTRA)
        )
        writer.flush()
    lane, usual = (msgspec.json.decode(line) for line in stream.getvalue().splitlines())
    assert lane.pop("time")[:16] == usual.pop("time")[:16]  # (the same minute: made a moment apart)
    assert lane == usual and lane["message"] == "request 01ABC m -> local instance 0 key k"


def test_a_routine_record_keeps_the_time_it_was_logged_at() -> None:
    record = _routine_record(123.456, NAME, "m", (), dict(EXTRA))
    assert msgspec.json.decode(JsonFormatter().format(record))["time"] == "1970-01-01T00:02:03.456Z"
    assert logging.Formatter("%(asctime)s").format(record).endswith(",456")


def test_anything_else_on_the_way_takes_the_usual_way() -> None:
    with alone() as (writer, stream):
        root = logging.getLogger()
        other = logging.NullHandler()
        root.addHandler(other)  # as pytest's caplog does
        assert not writer.routine(LOGGER, *line("x"))
        root.removeHandler(other)
        logging.getLogger(NAME).setLevel(logging.WARNING)
        assert not writer.routine(LOGGER, *line("x"))
        logging.getLogger(NAME).setLevel(logging.NOTSET)
        logging.getLogger(NAME).disabled = True
        assert not writer.routine(LOGGER, *line("x"))
        logging.getLogger(NAME).disabled = False
        writer.addFilter(lambda record: False)
        assert not writer.routine(LOGGER, *line("x"))
        writer.flush()
        assert stream.getvalue() == ""  # nothing was queued by a refusal
        writer.filters.clear()
        assert writer.routine(LOGGER, *line("x"))  # and alone again, the lane is open


def test_due_wakes_the_writer_for_a_waiting_routine_line() -> None:
    """A routine line waits for the writer's round (an hour here); ``due()`` sends it now."""
    with alone() as (writer, stream):
        writer.start()
        try:
            writer.due()  # nothing waits: nothing to write
            assert writer.routine(LOGGER, *line("request 01ABC"))
            writer.due()
            deadline = time.monotonic() + 10
            while "01ABC" not in stream.getvalue():
                assert time.monotonic() < deadline, "the routine line was not written after due()"
                time.sleep(0.005)
            assert stream.getvalue().count("request 01ABC") == 1
        finally:
            writer.stop()


@pytest.mark.parametrize("answer", ["json", "end"])
async def test_an_answer_sends_the_routine_line_on_before_its_last_bytes(
    answer: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    order: list[str] = []
    monkeypatch.setattr(log_format, "_active", SimpleNamespace(due=lambda: order.append("due")))
    exchange = _exchange(order)
    if answer == "json":
        await exchange.json(200, b"{}", [])
    else:
        exchange.start([])
        await exchange.end(b"data: [DONE]\n\n")
    assert order[-2:] == ["due", "last bytes"] and order.count("due") == 1


def _exchange(order: list[str]) -> Exchange:
    transport = SimpleNamespace(
        write=lambda data: order.append("last bytes"), close=lambda: None, is_closing=lambda: False
    )
    connection = SimpleNamespace(transport=transport, write_paused=False, answered=lambda exchange: None)
    return Exchange(connection, "POST", "/v1/chat/completions", b"", [], b"", True)


def test_the_request_line_is_made_in_the_writers_round_as_log_info_writes_it() -> None:
    """Events hands the writer the request line's function and values; the line it writes is the one
    ``log.info`` writes for the same request, the caller's ID included."""
    from capyctl.services.events import selection_line

    values = ("01ABC", "caller-7", "m", "local", 0, "k")
    with alone() as (writer, stream):
        assert writer.routine(LOGGER, selection_line, values)
        message, args, extra = selection_line(*values)
        LOGGER.info(message, *args, extra=extra)
        writer.flush()
    lane, usual = (msgspec.json.decode(text) for text in stream.getvalue().splitlines())
    assert lane.pop("time")[:16] == usual.pop("time")[:16]
    assert lane == usual
    assert lane["message"] == "request 01ABC (caller caller-7) m -> local instance 0 key k"
    assert lane["caller_request_id"] == "caller-7" and lane["event"] == "router_selection"


def test_a_line_function_that_breaks_loses_its_line_only() -> None:
    def broken(value: str) -> tuple[str, tuple[object, ...], dict[str, object]]:
        raise ValueError(value)

    with alone() as (writer, stream):
        writer.handleError = lambda record: None  # type: ignore[method-assign]  # (logging would print it)
        assert writer.routine(LOGGER, broken, ("x",))
        assert writer.routine(LOGGER, *line("after it"))
        writer.flush()
    assert [msgspec.json.decode(text)["message"] for text in stream.getvalue().splitlines()] == ["after it"]


def _messages(text: str) -> list[str]:
    return [msgspec.json.decode(row)["message"] for row in text.splitlines()]


def _unread(fd: int) -> str:
    """What the pipe holds now, without waiting."""
    os.set_blocking(fd, False)
    try:
        return os.read(fd, 1 << 20).decode()
    except BlockingIOError:
        return ""


def _read_to_the_end(fd: int) -> None:
    os.set_blocking(fd, True)
    with contextlib.suppress(OSError):
        while os.read(fd, 65536):
            pass


def test_due_writes_the_waiting_lines_itself_to_a_pipe_that_takes_them() -> None:
    """No thread switch: the lines are in the pipe when ``due()`` returns (the writer thread never runs)."""
    read_fd, write_fd = os.pipe()
    try:
        with open(write_fd, "w") as pipe, alone(pipe) as (writer, _):
            assert writer.routine(LOGGER, *line("request 01ABC"))
            logging.getLogger(NAME).info("request cut: engine connection closed")  # (this one woke no one)
            assert writer.routine(LOGGER, *line("request 01ABD"))
            writer.due()
            assert _messages(_unread(read_fd)) == [
                "request 01ABC",
                "request cut: engine connection closed",
                "request 01ABD",
            ]
            writer.due()  # nothing waits any more
            assert _unread(read_fd) == ""
    finally:
        os.close(read_fd)


def test_due_writes_any_length_to_a_regular_file(tmp_path: Path) -> None:
    with open(tmp_path / "log", "w") as log, alone(log) as (writer, _):
        assert writer.routine(LOGGER, *line("x" * 20000))
        writer.due()
        assert _messages((tmp_path / "log").read_text()) == ["x" * 20000]


def test_lines_longer_than_a_pipe_takes_at_once_are_left_to_the_writer_in_their_order() -> None:
    read_fd, write_fd = os.pipe()
    try:
        with open(write_fd, "w") as pipe, alone(pipe) as (writer, _):
            assert writer.routine(LOGGER, *line("y" * 5000))  # past PIPE_BUF: a write that could block
            writer.due()
            assert _unread(read_fd) == ""
            assert writer.routine(LOGGER, *line("after it"))
            writer.flush()  # the writer's round
            got = ""
            deadline = time.monotonic() + 10
            while got.count("\n") < 2:
                assert time.monotonic() < deadline, f"the writer wrote only {got!r}"
                got += _unread(read_fd)
            assert _messages(got) == ["y" * 5000, "after it"]
    finally:
        os.close(read_fd)


def test_due_never_blocks_on_a_full_pipe_and_the_writer_sends_the_line_once_it_drains() -> None:
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    for size in (65536, 1):  # until the pipe takes not one byte more
        with contextlib.suppress(BlockingIOError):
            while True:
                os.write(write_fd, b"." * size)
    os.set_blocking(write_fd, True)
    try:
        with open(write_fd, "w") as pipe, alone(pipe) as (writer, _):
            writer.start()
            try:
                assert writer.routine(LOGGER, *line("request 01ABC"))
                caller = threading.Thread(target=writer.due)
                caller.start()
                caller.join(10)
                assert not caller.is_alive(), "due() waited on a full pipe"
                got = ""
                deadline = time.monotonic() + 10
                while "request 01ABC" not in got:  # the writer thread, woken by due(), waits on the pipe
                    assert time.monotonic() < deadline, "the line never came once the pipe was read"
                    got += _unread(read_fd)
                    time.sleep(0.001)
                assert _messages(got.lstrip(".")) == ["request 01ABC"]
            finally:
                threading.Thread(target=_read_to_the_end, args=(read_fd,), daemon=True).start()  # (had it failed)
                writer.stop()
    finally:
        os.close(read_fd)


@pytest.mark.parametrize("formatter", [JsonFormatter(), TextFormatter()], ids=["json", "text"])
@pytest.mark.parametrize(
    "message, args",
    [
        ("request %s%s %s -> %s instance %d key %s", ("01ABC", " (caller c)", "m", "local", 0, "k")),
        ("100% plain, no arguments", ()),
        ("by name %(who)s", ({"who": "mapping"},)),
    ],
)
@pytest.mark.parametrize("created", [123.456, 1796177298.9999, 1796177299.0])
def test_a_routine_line_is_formatted_without_a_record_exactly_as_its_record_would_be(
    formatter: logging.Formatter, message: str, args: tuple[Any, ...], created: float
) -> None:
    made = formatter.routine(created, NAME, message, args, dict(EXTRA))  # type: ignore[attr-defined]
    assert made == formatter.format(_routine_record(created, NAME, message, args, dict(EXTRA)))


def test_the_writer_formats_a_routine_line_without_a_record_only_where_that_is_exact() -> None:
    made: list[str] = []

    class Counting(JsonFormatter):
        def format(self, record: logging.LogRecord) -> str:
            made.append(record.getMessage())
            return super().format(record)

    with alone() as (writer, stream):
        writer.setFormatter(Counting())
        assert writer.routine(LOGGER, *line("without a record"))
        # a field that names an attribute of a record changes the record: it takes the usual way
        assert writer.routine(LOGGER, lambda: ("with a record", (), {"lineno": 7}), ())
        assert writer.routine(LOGGER, lambda: ("broken %d", ("x",), {}), ())  # a bad format: said on stderr
        writer.flush()
    assert made == ["with a record"]
    written = [msgspec.json.decode(text) for text in stream.getvalue().splitlines()]
    assert [entry["message"] for entry in written] == ["without a record", "with a record"]
    assert written[0]["event"] == "router_selection" and "_routine" not in written[0]


def test_configure_logging_writes_text_lines_with_the_time_of_day(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = io.StringIO()
    monkeypatch.setattr(log_format.sys, "stderr", stream)
    monkeypatch.setattr(log_format, "_active", log_format._active)  # all put back as they were after the test
    for name in ("_srcfile", "logThreads", "logProcesses", "logMultiprocessing"):
        monkeypatch.setattr(logging, name, getattr(logging, name))
    httpx_level = logging.getLogger("httpx").level
    root = logging.getLogger()
    saved, level = root.handlers[:], root.level
    try:
        writer = log_format.configure_logging("text")
        assert isinstance(writer.formatter, TextFormatter)
        assert writer.routine(LOGGER, *line("request 01ABC"))
        writer.stop()
    finally:
        root.handlers[:] = saved
        root.setLevel(level)
        logging.getLogger("httpx").setLevel(httpx_level)
    text = stream.getvalue()
    assert text.endswith(" request 01ABC\n") and time.strptime(text.split(" ")[0], "%H:%M:%S")


async def test_a_selection_line_waits_for_the_next_turn() -> None:
    """The selection's line is handed to the log at the loop's next turn (the engine write goes first); the
    event is stored at once."""
    import asyncio

    from capyctl.services.events import Events, selection_line
    from tests.fakes.ports import FakeStore

    handed: list[tuple[Any, ...]] = []
    store = FakeStore()
    clock: Any = SimpleNamespace(wall=lambda: 1.0)
    events = Events(store, clock, lambda logger, line, values: handed.append(values))
    events.selection("01A", "m", "host", 0, "alice")
    assert handed == []
    assert [e["detail"]["capyctl_request_id"] for e in store.events if e["kind"] == "router_selection"] == ["01A"]
    await asyncio.sleep(0)
    assert [values[0] for values in handed] == ["01A"]
    assert selection_line(*handed[0])[2]["capyctl_request_id"] == "01A"
