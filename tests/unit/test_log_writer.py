"""The log writer: lines leave in order, in batches from their own thread, as they were when logged."""

from __future__ import annotations

import io
import logging
import time

import msgspec

from capyctl.adapters.log_format import BatchedWriter, JsonFormatter


class CountingStream(io.StringIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, text: str) -> int:
        self.writes += 1
        return super().write(text)


def logger_to(handler: logging.Handler) -> logging.Logger:
    log = logging.getLogger(f"capyctl.test.writer.{id(handler)}")
    log.propagate = False
    log.handlers[:] = [handler]
    log.setLevel(logging.INFO)
    return log


def test_lines_come_in_order_in_one_write_and_say_what_was_true_when_logged() -> None:
    stream = CountingStream()
    writer = BatchedWriter(stream, every=3600)  # the thread would not wake during the test: stop() writes
    writer.setFormatter(logging.Formatter("%(message)s"))
    writer.start()
    log = logger_to(writer)
    state = ["before"]
    for i in range(100):
        log.info("line %d %s", i, state, extra={"_routine": True})
    state[0] = "after"  # changed once logged: the line keeps what it said
    assert stream.getvalue() == ""  # nothing written by the event loop's own thread
    writer.stop()
    assert stream.getvalue().splitlines() == [f"line {i} ['before']" for i in range(100)]
    assert stream.writes == 1


def test_a_line_that_is_not_routine_is_written_at_once() -> None:
    stream = CountingStream()
    writer = BatchedWriter(stream, every=3600)  # no round during the test: only the line's own wake writes it
    writer.setFormatter(JsonFormatter())
    writer.start()
    try:
        log = logger_to(writer)
        log.info("routine", extra={"_routine": True})
        log.info("request cut: engine connection closed", extra={"event": "cut"})
        deadline = time.monotonic() + 10
        while "engine connection closed" not in stream.getvalue():
            assert time.monotonic() < deadline, "the writer did not wake for a line that is not routine"
            time.sleep(0.01)
        lines = stream.getvalue().splitlines()
        assert [msgspec.json.decode(line)["message"] for line in lines] == [
            "routine",
            "request cut: engine connection closed",
        ]
        assert '"_routine"' not in stream.getvalue() and '"event":"cut"' in lines[1]
    finally:
        writer.stop()


def test_routine_lines_leave_with_the_next_round() -> None:
    stream = CountingStream()
    writer = BatchedWriter(stream, every=0.01)
    writer.setFormatter(JsonFormatter())
    writer.start()
    try:
        logger_to(writer).info("hello %s", "there", extra={"event": "e", "_routine": True})
        deadline = time.monotonic() + 10
        while "hello there" not in stream.getvalue():
            assert time.monotonic() < deadline, "the writer thread never wrote the line"
            time.sleep(0.01)
        assert '"event":"e"' in stream.getvalue()
    finally:
        writer.stop()


def test_a_line_with_a_wrong_format_is_reported_and_the_others_still_come(capsys) -> None:  # type: ignore[no-untyped-def]
    stream = CountingStream()
    writer = BatchedWriter(stream, every=3600)
    writer.setFormatter(logging.Formatter("%(message)s"))
    writer.start()
    log = logger_to(writer)
    log.info("bad %d", "x")
    log.info("good")
    writer.stop()
    assert stream.getvalue() == "good\n"
    assert "bad %d" in capsys.readouterr().err
