"""The record CapyCTL keeps while an engine works on a request.

It holds no caller identifiers: the caller's own ``X-Request-Id`` lives only
in the log context, never here.
"""

from __future__ import annotations

import enum

import msgspec

from capyctl.domain.errors import InvalidRequest


class Phase(enum.StrEnum):
    RECEIVED = "received"
    WAITING = "waiting"  # for its deployment to become ready
    SENT = "sent"  # to the engine
    ANSWERING = "answering"  # the engine has produced text or an error
    DONE = "done"
    CANCELLED = "cancelled"
    FAILED = "failed"


class CancelCause(enum.StrEnum):
    CLIENT_GONE = "client_gone"
    DEADLINE = "deadline"
    IDLE = "stream_idle"
    ENGINE_EXITED = "engine_exited"
    UNVERIFIED = "unverified"
    HOST_LOST = "host_lost"  # the host its engine runs on went silent past hosts.lost_after while it answered


class RequestRecord(msgspec.Struct, kw_only=True):
    id: str
    deployment: str
    stream: bool
    phase: Phase = Phase.RECEIVED
    instance: int | None = None
    answered: bool = False
    cause: CancelCause | None = None
    key: str | None = None  # the name of the API key it came with (never its secret)
    salt_bound: bool = False  # that key binds a cache salt: it is the key's, not the client's
    waited: float | None = None  # seconds it waited in line for its deployment (None: it did not wait)

    def sent(self, instance: int) -> None:
        self.instance = instance
        self.phase = Phase.SENT

    def engine_answered(self) -> None:
        self.answered = True
        self.phase = Phase.ANSWERING

    def cancelled(self, cause: CancelCause) -> None:
        self.cause = cause
        self.phase = Phase.CANCELLED


def check_caller_id(values: list[str]) -> str | None:
    """The caller's ``X-Request-Id``: 1-128 printable ASCII characters, no spaces, given at most once."""
    if not values:
        return None
    if len(values) > 1:
        raise InvalidRequest("X-Request-Id was given more than once; send it once", param="X-Request-Id")
    value = values[0]
    if not 1 <= len(value) <= 128 or not all("!" <= char <= "~" for char in value):
        raise InvalidRequest(
            "X-Request-Id must be 1 to 128 printable ASCII characters without spaces", param="X-Request-Id"
        )
    return value
