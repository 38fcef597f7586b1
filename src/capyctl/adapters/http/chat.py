"""``POST /v1/chat/completions``: streamed answers relayed as SSE, others assembled (behind ``front.FrontDoor``).

Before a stream's 200 is sent, errors are JSON answers with their status;
after it, an error is one SSE error event and the stream ends. Nothing is
logged per chunk.
"""

from __future__ import annotations

import functools
import time
from typing import Any

from capyctl.adapters.http.errors import error_body, retry_after, sse_error_event, status_of
from capyctl.adapters.http.exchange import Exchange
from capyctl.adapters.http.front import Headers, Outcome, send_one_answer
from capyctl.adapters.http.prometheus import RequestStats
from capyctl.domain.errors import CapyError, InvalidRequest
from capyctl.domain.requests import Phase, RequestRecord
from capyctl.services.chat import ChatService, Started, failure_error, read_target

_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-store"), (b"x-accel-buffering", b"no")]
# Refusals a streaming client gets as an SSE error event rather than a JSON answer (SALT-2).
_STREAMED_REFUSALS = frozenset({"cache_salt_unsupported"})
CHAT_PATH = "/v1/chat/completions"


class ChatEndpoint:
    """``POST /v1/chat/completions``: streamed answers relayed as SSE, others assembled."""

    path = CHAT_PATH

    def __init__(self, service: ChatService, stats: RequestStats) -> None:
        self.service = service
        self._service = service
        self._stats = stats

    def target(self, obj: dict[str, Any]) -> tuple[str, bool]:
        if "return_hidden_states" in obj:
            raise InvalidRequest("'return_hidden_states' is not supported", param="return_hidden_states")
        return read_target(obj, self._service.default_model)

    def start(self, record: RequestRecord, obj: dict[str, Any]) -> Started:
        return self._service.start(record, obj)

    async def answer(
        self,
        record: RequestRecord,
        obj: dict[str, Any],
        wait: float | None,
        exchange: Exchange,
        headers: Headers,
        outcome: Outcome,
        received_at: float,
        started: Started | None = None,
    ) -> None:
        if record.stream:
            await self._stream(record, obj, wait, exchange, headers, outcome, started)
        else:
            await send_one_answer(
                self._service.complete(record, obj, wait, started), record, exchange, headers, outcome
            )

    async def late_error(self, error: CapyError, exchange: Exchange, headers: Headers, outcome: Outcome) -> None:
        if outcome.started:
            await exchange.end(sse_error_event(error))
        else:
            await exchange.json(status_of(error), error_body(error), headers)

    async def _stream(
        self,
        record: RequestRecord,
        obj: dict[str, Any],
        wait: float | None,
        exchange: Exchange,
        headers: Headers,
        outcome: Outcome,
        started: Started | None,
    ) -> None:
        opened = False
        try:
            async with self._service.open(record, obj, wait, started) as call:
                opened = True
                exchange.start(_SSE_HEADERS + headers[1:])  # made while the engine works on the first token
                last = await call.pump(functools.partial(self._write, record, exchange, outcome), exchange.drain)
            failure = call.failure
            if failure is None:
                record.phase = Phase.DONE
                outcome.code = "ok"
                outcome.measured(call.metrics(), call.usage)
            else:
                record.phase = Phase.FAILED
                outcome.code = failure_error(failure).code
        except CapyError as error:
            record.phase = Phase.FAILED
            outcome.code = error.code
            if not outcome.started and not opened and error.code not in _STREAMED_REFUSALS:
                outcome.status = status_of(error)
                await exchange.json(outcome.status, error_body(error), headers + retry_after(error))
                return
            if not outcome.started:  # the engine accepted the request: the client gets a stream with the error
                outcome.started = True
                exchange.start(_SSE_HEADERS + headers[1:])
            await exchange.end(sse_error_event(error))
            return
        if outcome.started:
            await exchange.end(last)
        else:  # the whole answer came in one read
            began = time.perf_counter()
            outcome.started = True
            await exchange.end(last)
            if last:
                self._stats.relayed_first_chunk(record.deployment, time.perf_counter() - began)

    def _write(self, record: RequestRecord, exchange: Exchange, outcome: Outcome, data: bytes) -> bool:
        """One read's relayed bytes, written at once from the engine connection's callback: True when the client
        cannot take more for now. The headers go out with the first (one wake-up for the client)."""
        if outcome.started:
            return exchange.write_now(data)
        began = time.perf_counter()
        outcome.started = True
        full = exchange.write_now(data)
        self._stats.relayed_first_chunk(record.deployment, time.perf_counter() - began)
        return full
