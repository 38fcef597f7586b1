"""The one table from error codes to HTTP statuses, and the OpenAI error envelope."""

from __future__ import annotations

from typing import Any

import msgspec

from capyctl.domain.errors import CapyError, EngineError, EngineRejected

STATUS: dict[str, int] = {
    "invalid_json": 400,
    "invalid_request": 400,
    "invalid_config": 400,
    "invalid_engine": 400,
    "cache_salt_unsupported": 400,
    "api_mismatch": 400,
    "missing_api_key": 401,
    "invalid_api_key": 401,
    "unauthorized": 401,
    "forbidden": 403,
    "daily_limit": 429,
    "model_not_found": 404,
    "deployment_not_found": 404,
    "engine_not_found": 404,
    "key_not_found": 404,
    "host_not_found": 404,
    "host_revoked": 403,
    "device_offline": 503,
    "gate_refused": 403,
    "join_refused": 403,
    "not_found": 404,
    "method_not_allowed": 405,
    "deployment_stopped": 409,
    "already_exists": 409,
    "engine_in_use": 409,
    "request_timeout": 408,
    "too_large": 413,
    "queue_full": 429,
    "engine_unavailable": 502,
    "engine_restarted": 502,
    "llm-unavailable": 502,
    "edge_error": 502,
    "unverified_stream": 502,
    "deadline_exceeded": 504,
    "stream_idle_timeout": 504,
    "internal_error": 500,
    "too_many_connections": 503,
    "model_loading": 503,
    "queued": 503,
    "device_busy": 503,
    "gpu-busy": 503,
    "insufficient_memory": 503,
    "not_placed": 503,
    "still_serving": 409,
    "engine_rejected": 400,  # answered with the engine's own status
}
_OWN_TYPE = frozenset({"edge_error"})  # codes whose envelope type is the code itself (Citadel)


def status_of(error: CapyError) -> int:
    if isinstance(error, EngineError | EngineRejected):
        return error.status if 400 <= error.status <= 599 else 502
    return STATUS.get(error.code, 500)


def error_type(status: int) -> str:
    if status == 429:
        return "rate_limit_exceeded"
    if status == 503:
        return "service_unavailable"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def envelope(error: CapyError) -> dict[str, Any]:
    status = status_of(error)
    kind = error.code if isinstance(error, EngineError) or error.code in _OWN_TYPE else error_type(status)
    return {"error": {"message": error.message, "type": kind, "code": error.code, **error.extra}}


def error_body(error: CapyError) -> bytes:
    return msgspec.json.encode(envelope(error))


def sse_error_event(error: CapyError) -> bytes:
    return b"data: " + error_body(error) + b"\n\n"


def retry_after(error: CapyError) -> list[tuple[bytes, bytes]]:
    """The ``Retry-After`` header of an error that says when to come back, else nothing."""
    seconds = getattr(error, "retry_after", None)
    return [] if seconds is None else [(b"retry-after", str(int(seconds)).encode())]
