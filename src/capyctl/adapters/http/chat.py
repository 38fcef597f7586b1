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
from capyctl.adapters.http.front import Request, send_one_answer
from capyctl.adapters.http.prometheus import RequestStats
from capyctl.domain.errors import CapyError, InvalidRequest
from capyctl.domain.requests import Phase
from capyctl.services.chat import ChatService, failure_error, read_target

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

    def start(self, request: Request) -> None:
        self._service.start(request)

    async def answer(self, request: Request) -> None:
        if request.stream:
            await self._stream(request)
        else:
            await send_one_answer(self._service.complete(request), request)

    async def late_error(self, error: CapyError, request: Request) -> None:
        if request.started:
            await request.exchange.end(sse_error_event(error))
        else:
            await request.exchange.json(status_of(error), error_body(error), request.headers)

    async def _stream(self, request: Request) -> None:
        exchange, headers = request.exchange, request.headers
        opened = False
        try:
            async with self._service.open(request):
                opened = True
                exchange.start(_SSE_HEADERS + headers[1:])  # made while the engine works on the first token
                last = await request.pump(functools.partial(self._write, request), exchange.drain)
            failure = request.failure
            if failure is None:
                request.phase = Phase.DONE
                request.code = "ok"
                request.measured(request.metrics(), request.seen_usage)
            else:
                request.phase = Phase.FAILED
                request.code = failure_error(failure).code
        except CapyError as error:
            request.phase = Phase.FAILED
            request.code = error.code
            if not request.started and not opened and error.code not in _STREAMED_REFUSALS:
                request.status = status_of(error)
                await exchange.json(request.status, error_body(error), headers + retry_after(error))
                return
            if not request.started:  # the engine accepted the request: the client gets a stream with the error
                request.started = True
                exchange.start(_SSE_HEADERS + headers[1:])
            await exchange.end(sse_error_event(error))
            return
        if request.started:
            await exchange.end(last)
        else:  # the whole answer came in one read
            began = time.perf_counter()
            request.started = True
            await exchange.end(last)
            if last:
                self._stats.relayed_first_chunk(request.deployment, time.perf_counter() - began)

    def _write(self, request: Request, data: bytes) -> bool:
        """One read's relayed bytes, written at once from the engine connection's callback: True when the client
        cannot take more for now. The headers go out with the first (one wake-up for the client)."""
        if request.started:
            return request.exchange.write_now(data)
        began = time.perf_counter()
        request.started = True
        full = request.exchange.write_now(data)
        self._stats.relayed_first_chunk(request.deployment, time.perf_counter() - began)
        return full
