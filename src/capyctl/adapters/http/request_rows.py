"""The request record's row, made by the front door as a request ends (``domain/request_rows``).

Only what the request's call (``services.requests.Call``) already holds is
read: its record (key name, deployment, instance, wait, cut cause), how it
ended (code, status, the figures of its answer) and two clock readings the
front door passes.
Nothing here reads a header: the caller's ``X-Request-Id`` cannot reach a
row.
"""

from __future__ import annotations

from typing import Any

import msgspec

from capyctl.adapters.http.errors import STATUS, status_of
from capyctl.domain.errors import CapyError, InternalError
from capyctl.domain.request_rows import RequestRow, clip_name
from capyctl.domain.settlement import rule_for
from capyctl.services.requests import Call

APIS = {"/v1/chat/completions": "chat", "/v1/systemone": "decisions"}


def finished_row(call: Call, path: str, at: float, total_ms: float) -> RequestRow:
    """The row of a request that had a record: answered, refused by the scheduler, failed or cut."""
    figures, usage = call.figures or {}, call.usage if isinstance(call.usage, dict) else {}
    code = call.code
    status = call.status or (200 if code == "ok" or call.started else STATUS.get(code))
    cut = call.cause is not None and call.instance is not None  # cut once an engine had it: settled later
    waited = call.waited
    return RequestRow(
        id=call.id,
        at=at,
        api=APIS.get(path, path),
        code=code,
        status=status,
        deployment=clip_name(call.deployment),
        key=call.key,
        instance=call.instance,
        stream=call.stream,
        total_ms=round(total_ms, 2),
        queue_wait_ms=round(waited * 1000, 2) if waited is not None else (0.0 if call.instance is not None else None),
        ttft_ms=_value(figures, "ttft_ms", call.ttft_ms),
        queue_ms=_value(figures, "queue_ms"),
        prefill_ms=_value(figures, "prefill_ms"),
        decode_tokens_per_second=_value(figures, "decode_tokens_per_second"),
        prompt_tokens=_count(usage.get("prompt_tokens", _value(figures, "input_tokens"))),  # (decisions: input)
        cached_tokens=_count(_value(figures, "cached_tokens")),
        completion_tokens=_count(usage.get("completion_tokens")),
        cause=None if call.cause is None else str(call.cause),
        settlement=rule_for(call.answered) if cut else None,
    )


def refused_row(
    request_id: str, error: CapyError, path: str, at: float, key: str | None = None, deployment: str | None = None
) -> RequestRow:
    """The row of a request refused at the front, before it had a record (key, body, headers, daily limit), with
    the key's name and the model named, where the front had read them before it refused."""
    return RequestRow(
        id=request_id,
        at=at,
        api=APIS.get(path, path),
        code=error.code,
        status=status_of(error),
        key=key,
        deployment=None if deployment is None else clip_name(deployment),
    )


def broken_row(
    request_id: str,
    path: str,
    at: float,
    started: bool,
    key: str | None = None,
    deployment: str | None = None,
    stream: bool = False,
) -> RequestRow:
    """The row of a request CapyCTL itself failed (the last resort answered ``internal_error``): status 500, or
    200 when its stream had begun before the fault."""
    error = InternalError(request_id)
    row = refused_row(request_id, error, path, at, key, deployment)
    return msgspec.structs.replace(row, status=200 if started else row.status, stream=stream)


def _value(figures: dict[str, Any], name: str, default: Any = None) -> Any:
    figure = figures.get(name)
    return figure.get("value", default) if isinstance(figure, dict) else default


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
