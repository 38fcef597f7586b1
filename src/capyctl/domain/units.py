"""Durations and sizes as CapyCTL's files and flags write them: ``90s``, ``10m``, ``1h``; ``512MiB``, ``2.5GiB``.

The annotated types carry the same patterns into the JSON Schemas of the
files (``capyctl config schema``); the parsers turn text into seconds and bytes.
"""

from __future__ import annotations

import re
from typing import Annotated

import msgspec

from capyctl.domain.errors import InvalidConfig

DURATION_PATTERN = r"^\s*\d+(\.\d+)?\s*(ms|s|m|h)?\s*$"
SIZE_PATTERN = r"^\s*\d+(\.\d+)?\s*(B|KiB|MiB|GiB|TiB|KB|MB|GB|TB)?\s*$"
Duration = Annotated[str, msgspec.Meta(pattern=DURATION_PATTERN, description="a duration: 90s, 10m, 1h, 250ms")] | Annotated[
    float, msgspec.Meta(gt=0, description="seconds")
]
Size = Annotated[str, msgspec.Meta(pattern=SIZE_PATTERN, description="a size: 64KiB, 4MiB, 2.5GiB")] | Annotated[
    int, msgspec.Meta(gt=0, description="bytes")
]

_DURATION = re.compile(DURATION_PATTERN.replace(r"\d+(\.\d+)?", r"(\d+(?:\.\d+)?)"))
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
_SIZE = re.compile(SIZE_PATTERN.replace(r"\d+(\.\d+)?", r"(\d+(?:\.\d+)?)"))
_KI = 1024
_UNIT_BYTES = {None: 1, "B": 1, "KiB": _KI, "MiB": _KI**2, "GiB": _KI**3, "TiB": _KI**4,
               "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4}


def parse_duration(text: str, what: str) -> float:
    """Seconds from '300s', '10m', '1.5h', '250ms' or a bare number of seconds."""
    match = _DURATION.match(text)
    if not match or float(match.group(1)) <= 0:
        raise InvalidConfig(f"{what}: {text!r} is not a duration; write it like 300s, 10m or 1h")
    return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def parse_size(text: str, what: str) -> int:
    """Bytes from '512MiB', '2.5GiB', '64KiB', '1MB' or a bare number of bytes."""
    match = _SIZE.match(text)
    if not match or float(match.group(1)) <= 0 or int(float(match.group(1)) * _UNIT_BYTES[match.group(2)]) <= 0:
        raise InvalidConfig(f"{what}: {text!r} is not a size; write it like 64KiB, 4MiB or 6GiB")
    return int(float(match.group(1)) * _UNIT_BYTES[match.group(2)])


def seconds(value: str | float, what: str) -> float:
    return float(value) if not isinstance(value, str) else parse_duration(value, what)


def size(value: str | int, what: str) -> int:
    return value if not isinstance(value, str) else parse_size(value, what)
