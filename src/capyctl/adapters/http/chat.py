"""``POST /v1/chat/completions``: streamed answers relayed as SSE, others assembled (behind ``front.FrontDoor``).

Before a stream's 200 is sent, errors are JSON answers with their status;
after it, an error is one SSE error event and the stream ends. Nothing is
logged per chunk.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import msgspec

from capyctl.adapters.http.errors import error_body, retry_after, sse_error_event, status_of
from capyctl.adapters.http.exchange import Exchange
from capyctl.adapters.http.front import Headers, Outcome, send_one_answer
from capyctl.adapters.http.prometheus import RequestStats
from capyctl.domain.errors import CapyError, InvalidRequest
from capyctl.domain.requests import Phase, RequestRecord
from capyctl.domain.streams import Chunk, Comment, Done, EngineFailure, Relayed, Run, StreamEvent
from capyctl.services.chat import ChatService, EngineCall, Started, failure_error, read_target

_encode = msgspec.json.encode
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-store"), (b"x-accel-buffering", b"no")]
_DONE = b"data: [DONE]\n\n"
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

    async def answer(self, record: RequestRecord, obj: dict[str, Any], wait: float | None, exchange: Exchange,
                     headers: Headers, outcome: Outcome, received_at: float, started: Started | None = None) -> None:
        if record.stream:
            await self._stream(record, obj, wait, exchange, headers, outcome, started)
        else:
            await send_one_answer(self._service.complete(record, obj, wait, started), record, exchange, headers,
                                  outcome)

    async def late_error(self, error: CapyError, exchange: Exchange, headers: Headers, outcome: Outcome) -> None:
        if outcome.started:
            await exchange.end(sse_error_event(error))
        else:
            await exchange.json(status_of(error), error_body(error), headers)

    async def _stream(self, record: RequestRecord, obj: dict[str, Any], wait: float | None, exchange: Exchange,
                      headers: Headers, outcome: Outcome, started: Started | None) -> None:
        opened = False
        framing = _Framing()
        try:
            async with self._service.open(record, obj, wait, started) as call:
                opened = True
                exchange.start(_SSE_HEADERS + headers[1:])  # made while the engine works on the first token
                if exchange.pushes and call.pumps:  # relayed from the engine connection's callback, read by read
                    await call.pump(functools.partial(self._deliver, record, exchange, outcome, framing, call),
                                    exchange.drain)
                else:
                    async for batch in call.events:
                        data = framing.frame(batch, call, outcome)
                        if framing.last:  # the batch that ended the stream leaves with the stream's end
                            continue  # (the events end here: the relay stops at Done)
                        if outcome.started:  # the hot path
                            await exchange.write(data)
                        else:  # headers go out with the first chunk: one wake-up for the client
                            began = time.perf_counter()
                            outcome.started = True
                            await exchange.write(data)
                            self._stats.relayed_first_chunk(record.deployment, time.perf_counter() - began)
            failure = framing.failure
            if failure is None:
                record.phase = Phase.DONE
                outcome.code = "ok"
            else:
                record.phase = Phase.FAILED
                outcome.code = failure_error(failure.error).code
        except CapyError as error:
            record.phase = Phase.FAILED
            outcome.code = error.code
            if not outcome.started and not opened and error.code not in _STREAMED_REFUSALS:
                await exchange.json(status_of(error), error_body(error), headers + retry_after(error))
                return
            if not outcome.started:  # the engine accepted the request: the client gets a stream with the error
                outcome.started = True
                exchange.start(_SSE_HEADERS + headers[1:])
            await exchange.end(sse_error_event(error))
            return
        last = framing.last
        if outcome.started:
            await exchange.end(last)
        else:  # the whole answer came in one read
            began = time.perf_counter()
            outcome.started = True
            await exchange.end(last)
            if last:
                self._stats.relayed_first_chunk(record.deployment, time.perf_counter() - began)


    def _deliver(self, record: RequestRecord, exchange: Exchange, outcome: Outcome, framing: _Framing,
                 call: EngineCall, batch: list[StreamEvent]) -> Relayed:
        """One batch of a pumped stream, written at once (the pulled loop's body, without its awaits)."""
        data = framing.frame(batch, call, outcome)
        if framing.last:  # the batch that ended the stream leaves with the stream's end, after the call
            return Relayed.MORE
        if not outcome.started:  # headers go out with the first chunk
            began = time.perf_counter()
            outcome.started = True
            full = exchange.write_now(data)
            self._stats.relayed_first_chunk(record.deployment, time.perf_counter() - began)
            return Relayed.FULL if full else Relayed.MORE
        return Relayed.FULL if exchange.write_now(data) else Relayed.MORE


class _Framing:
    """A relayed stream's batches as the SSE bytes sent on: what pulling and pumping share."""

    __slots__ = ("failure", "last")

    def __init__(self) -> None:
        self.failure: EngineFailure | None = None  # the engine's own error event, when it sent one
        self.last = b""  # the bytes of the batch that ended the stream, once it came

    def frame(self, batch: list[StreamEvent], call: EngineCall, outcome: Outcome) -> bytes:
        if len(batch) == 1 and type(batch[0]) is Run:  # one read's run, the most usual batch at full speed
            return batch[0].sse  # type: ignore[union-attr]
        parts: list[bytes] = []
        for event in batch:
            if isinstance(event, Run):  # checked as a whole, already SSE: sent on as it came
                parts.append(event.sse)
            elif isinstance(event, Chunk):
                parts += (b"data: ", event.raw, b"\n\n")
            elif isinstance(event, EngineFailure):
                self.failure = event
                parts += (b"data: ", event.raw, b"\n\n")
            elif isinstance(event, Done):
                if self.failure is None:  # an answer that ended on the engine's error has no metrics
                    metrics = call.metrics()
                    outcome.ttft_ms = metrics.get("ttft_ms", {}).get("value")
                    parts += (b": x-capyctl-metrics ", _encode(metrics), b"\n\n")
                parts.append(_DONE)
                self.last = b"".join(parts)
                return self.last
            elif isinstance(event, Comment):
                parts += (event.raw, b"\n\n")
        return b"".join(parts)
