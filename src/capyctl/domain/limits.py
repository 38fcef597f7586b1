"""The limits that keep one client or one engine from taking the server's resources.

Each has a default and a ``capyctl start standalone`` flag (docs/errors.md,
"Limits"). Client-side limits protect the listening socket (a client must
send its request in time; connections are capped); engine-side limits
protect the relay from an engine that misbehaves (an event, or a number of
tool calls, past which its answer is refused as ``edge_error``).
"""

from __future__ import annotations

import re

import msgspec

from capyctl.domain.errors import InvalidConfig

MIB = 1024 * 1024


class Limits(msgspec.Struct, kw_only=True, frozen=True):
    max_body: int = 32 * MIB  # request body bytes (413 too_large)
    header_timeout: float = 10.0  # seconds for a client to send its request line and headers
    body_timeout: float = 60.0  # seconds for a client to send its body once the headers are in
    max_connections: int = 4096  # open client connections per API; past it, 503 too_many_connections
    max_event: int = 4 * MIB  # bytes in one engine SSE event; past it, edge_error
    max_tool_calls: int = 256  # tool calls in one answer; an index past it is edge_error


_SIZE = re.compile(r"^\s*(\d+)\s*(B|KiB|MiB|GiB|KB|MB|GB)?\s*$")
_UNIT_BYTES = {None: 1, "B": 1, "KiB": 1024, "MiB": MIB, "GiB": 1024 * MIB, "KB": 1000, "MB": 1000**2, "GB": 1000**3}


def parse_size(text: str, what: str) -> int:
    """Bytes from '512MiB', '6GiB', '64KiB', '1MB' or a bare number of bytes."""
    match = _SIZE.match(text)
    if not match or int(match.group(1)) <= 0:
        raise InvalidConfig(f"{what}: {text!r} is not a size; write it like 64KiB, 4MiB or 6GiB")
    return int(match.group(1)) * _UNIT_BYTES[match.group(2)]


def parse_count(text: str, what: str) -> int:
    if not text.strip().isdigit() or int(text) <= 0:
        raise InvalidConfig(f"{what}: {text!r} is not a positive whole number")
    return int(text)
