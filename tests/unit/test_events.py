"""Event log lines: the kind, the deployment, then each field; nothing after the last word."""

from __future__ import annotations

import logging

import pytest

from capyctl.adapters.log_format import TextFormatter
from capyctl.services.events import Events
from tests.fakes.ports import FakeClock, FakeStore


@pytest.mark.parametrize(
    ("deployment", "detail", "says"),
    [
        ("m1", {}, "ready m1"),
        (None, {}, "ready -"),
        ("m1", {"instance": 0, "port": 5555}, "ready m1 instance=0 port=5555"),
    ],
)
def test_an_event_line_ends_with_its_last_word(
    caplog: pytest.LogCaptureFixture, deployment: str | None, detail: dict[str, object], says: str
) -> None:
    store = FakeStore()
    with caplog.at_level(logging.INFO, logger="capyctl.events"):
        Events(store, FakeClock()).emit(deployment, "ready", **detail)
    (record,) = caplog.records
    assert record.getMessage() == says
    assert TextFormatter().format(record).endswith(f" {says}")
