"""The server file's ``records`` section: defaults, values, and clear refusals."""

from __future__ import annotations

import pytest

from capyctl.adapters.config_files import decode_text
from capyctl.domain.config import ServerConfig, resolve
from capyctl.domain.errors import InvalidConfig
from capyctl.domain.request_rows import RecordSettings, Retention


def settings(text: str) -> RecordSettings:
    return resolve(decode_text(text, "c.yaml", ServerConfig), {}).records


def test_the_defaults_keep_a_hundred_thousand_rows_for_a_week() -> None:
    assert settings("") == RecordSettings(retention=Retention(max_count=100_000, max_age=7 * 86400.0), buffer=10_000)


def test_the_file_sets_the_count_the_age_and_the_buffer() -> None:
    got = settings("records:\n  max_count: 500\n  max_age: 36h\n  buffer: 64\n")
    assert got.retention == Retention(max_count=500, max_age=36 * 3600.0) and got.buffer == 64


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("records:\n  max_count: 0\n", r"line 2: Expected `int` >= 1 \(at records.max_count\)"),
        ("records:\n  buffer: -5\n", r"line 2: Expected `int` >= 1 \(at records.buffer\)"),
        ("records:\n  max_age: 7d\n", r"line 2: .*duration more than zero such as 90s, 10m or 1h"),
        ("records:\n  max_age: 0\n", r"records.max_age: 0.0 is not a duration more than zero"),
        ("records:\n  keep: 5\n", r"line 2: Object contains unknown field `keep`"),
    ],
)
def test_bad_values_are_refused_naming_the_key(text: str, words: str) -> None:
    with pytest.raises(InvalidConfig, match=words):
        settings(text)
