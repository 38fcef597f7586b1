"""The limits that keep one client or one engine from taking the server's resources.

Each has a default and a ``capyctl start standalone`` flag (docs/errors.md,
"Limits"). Client-side limits protect the listening socket (a client must
send its request in time; connections are capped); engine-side limits
protect the relay from an engine that misbehaves (an event, or a number of
tool calls, past which its answer is refused as ``edge_error``).
"""

from __future__ import annotations

import msgspec

from capyctl.domain.errors import InvalidConfig
from capyctl.domain.units import parse_size as parse_size  # re-exported: the CLI parses flags with it

MIB = 1024 * 1024
HOST_MAX_BODY = 8 * MIB  # a request body a host's ingress takes: with several machines, no body is larger


def across_hosts(limits: Limits) -> Limits:
    """The limits of a server whose requests may go to hosts: no body past what an ingress takes, refused
    (413) at the server's door before any host sees a byte of it."""
    return msgspec.structs.replace(limits, max_body=min(limits.max_body, HOST_MAX_BODY))


class Limits(msgspec.Struct, kw_only=True, frozen=True):
    max_body: int = 32 * MIB  # request body bytes (413 too_large)
    header_timeout: float = 10.0  # seconds for a client to send its request line and headers
    body_timeout: float = 60.0  # seconds for a client to send its body once the headers are in
    max_connections: int = 4096  # open client connections per API; past it, 503 too_many_connections
    max_event: int = 4 * MIB  # bytes in one engine SSE event; past it, edge_error
    max_tool_calls: int = 256  # tool calls in one answer; an index past it is edge_error


def parse_count(text: str, what: str) -> int:
    if not text.strip().isdigit() or int(text) <= 0:
        raise InvalidConfig(f"{what}: {text!r} is not a positive whole number")
    return int(text)
