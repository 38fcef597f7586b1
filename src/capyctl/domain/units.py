"""Durations and sizes as CapyCTL's files and flags write them: ``90s``, ``10m``, ``1h``; ``512MiB``, ``2.5GiB``.

Most keys take a value more than zero (``Duration``, ``Size``); a few take
zero too (``DurationOrZero``, ``SizeOrZero``: a device's reserve, a parked
model's memory, the admission window). The annotated types carry the same
rules into the JSON Schemas of the files (``capyctl config schema``); the
parsers turn text into seconds and bytes and refuse what the key does not
take, saying what it takes: zero or not, and the units.
"""

from __future__ import annotations

import re
from typing import Annotated

import msgspec

from capyctl.domain.errors import InvalidConfig

_NUMBER = r"\d+(\.\d+)?"
_MORE_THAN_ZERO = r"(\d*[1-9]\d*(\.\d+)?|\d+\.\d*[1-9]\d*)"  # a number with a digit other than 0 in it
_DURATION_UNITS = r"(ms|s|m|h)?"
_SIZE_UNITS = r"(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)?"


def _pattern(number: str, units: str) -> str:
    return rf"^\s*{number}\s*{units}\s*$"


DURATION_PATTERN = _pattern(_MORE_THAN_ZERO, _DURATION_UNITS)
DURATION_OR_ZERO_PATTERN = _pattern(_NUMBER, _DURATION_UNITS)
SIZE_PATTERN = _pattern(_MORE_THAN_ZERO, _SIZE_UNITS)
SIZE_OR_ZERO_PATTERN = _pattern(_NUMBER, _SIZE_UNITS)

_DURATION_FORM = "with a unit of ms, s, m or h (none: seconds)"
_SIZE_FORM = "with a unit of B, KiB, MiB, GiB, TiB, KB, MB, GB or TB (none: bytes)"
# What each pattern means, for messages: the decoder's own names the regex, which tells an operator nothing.
MEANINGS = {
    DURATION_PATTERN: f"a duration more than zero such as 90s, 10m or 1h, {_DURATION_FORM}",
    DURATION_OR_ZERO_PATTERN: f"a duration of zero or more such as 0s, 2s or 500ms, {_DURATION_FORM}",
    SIZE_PATTERN: f"a size more than zero such as 64KiB, 4MiB or 6GiB, {_SIZE_FORM}",
    SIZE_OR_ZERO_PATTERN: f"a size of zero or more such as 0GiB, 512MiB or 2GiB, {_SIZE_FORM}",
}

# A bare number's bound is checked by ``seconds``/``size`` (whose message names the key and the units) rather
# than by the decoder (whose message would be "Expected `int` >= 1"); the schema still states it.
Duration = (
    Annotated[str, msgspec.Meta(pattern=DURATION_PATTERN, description=MEANINGS[DURATION_PATTERN])]
    | Annotated[float, msgspec.Meta(description="seconds, more than zero", extra_json_schema={"exclusiveMinimum": 0})]
)
DurationOrZero = (
    Annotated[str, msgspec.Meta(pattern=DURATION_OR_ZERO_PATTERN, description=MEANINGS[DURATION_OR_ZERO_PATTERN])]
    | Annotated[float, msgspec.Meta(description="seconds, zero or more", extra_json_schema={"minimum": 0})]
)
Size = (
    Annotated[str, msgspec.Meta(pattern=SIZE_PATTERN, description=MEANINGS[SIZE_PATTERN])]
    | Annotated[int, msgspec.Meta(description="bytes, more than zero", extra_json_schema={"exclusiveMinimum": 0})]
)
SizeOrZero = (
    Annotated[str, msgspec.Meta(pattern=SIZE_OR_ZERO_PATTERN, description=MEANINGS[SIZE_OR_ZERO_PATTERN])]
    | Annotated[int, msgspec.Meta(description="bytes, zero or more", extra_json_schema={"minimum": 0})]
)

_DURATION = re.compile(_pattern(rf"({_NUMBER})", _DURATION_UNITS))
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
_SIZE = re.compile(_pattern(rf"({_NUMBER})", _SIZE_UNITS))
_KI = 1024
_UNIT_BYTES = {
    None: 1,
    "B": 1,
    "KiB": _KI,
    "MiB": _KI**2,
    "GiB": _KI**3,
    "TiB": _KI**4,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
}


def _refused(what: str, value: object, pattern: str) -> InvalidConfig:
    return InvalidConfig(f"{what}: {value!r} is not {MEANINGS[pattern]}")


def parse_duration(text: str, what: str, *, zero: bool = False) -> float:
    """Seconds from '300s', '10m', '1.5h', '250ms' or a bare number of seconds; zero only where ``zero``."""
    match = _DURATION.match(text)
    value = float(match.group(1)) * _UNIT_SECONDS[match.group(3)] if match else -1.0
    if value < 0 or (value == 0 and not zero):
        raise _refused(what, text, DURATION_OR_ZERO_PATTERN if zero else DURATION_PATTERN)
    return value


def parse_size(text: str, what: str, *, zero: bool = False) -> int:
    """Bytes from '512MiB', '2.5GiB', '64KiB', '1MB' or a bare number of bytes; zero only where ``zero``."""
    match = _SIZE.match(text)
    value = int(float(match.group(1)) * _UNIT_BYTES[match.group(3)]) if match else -1
    if value < 0 or (value == 0 and not zero):
        raise _refused(what, text, SIZE_OR_ZERO_PATTERN if zero else SIZE_PATTERN)
    return value


def seconds(value: str | float, what: str, *, zero: bool = False) -> float:
    if isinstance(value, str):
        return parse_duration(value, what, zero=zero)
    if value < 0 or (value == 0 and not zero):
        raise _refused(what, value, DURATION_OR_ZERO_PATTERN if zero else DURATION_PATTERN)
    return float(value)


def size(value: str | int, what: str, *, zero: bool = False) -> int:
    if isinstance(value, str):
        return parse_size(value, what, zero=zero)
    if value < 0 or (value == 0 and not zero):
        raise _refused(what, value, SIZE_OR_ZERO_PATTERN if zero else SIZE_PATTERN)
    return value
