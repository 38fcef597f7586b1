"""Per-request log context.

The caller's own request ID (``X-Request-Id``) lives here and nowhere else:
it is written in log lines, never in the request record, the database, the
stored events, or a request to an engine.
"""

from __future__ import annotations

from contextvars import ContextVar

caller_request_id: ContextVar[str | None] = ContextVar("caller_request_id", default=None)
