"""``POST /v1/chat/completions`` as a bare ASGI handler: the relay's hot path.

Per request: authenticate, give it a ULID, check the caller's X-Request-Id,
read and decode the body once, then let ``ChatService`` drive the engine.
While CapyCTL waits for or relays the engine's answer, a watcher task
listens for the client's hang-up and cancels the scope that owns the engine
connection, streamed or not. Before a stream's 200 is sent, errors are JSON
answers with their status; after it, an error is one SSE error event and the
stream ends. Nothing is logged per chunk.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import anyio
import msgspec
from ulid import ULID

from capyctl.adapters.http.asgi import (
    ClientGone,
    Scope,
    header,
    header_values,
    read_body,
    send_json,
    watch_disconnect,
)
from capyctl.adapters.http.errors import error_body, sse_error_event, status_of
from capyctl.adapters.http.prometheus import RequestStats
from capyctl.domain.auth import check_bearer
from capyctl.domain.errors import CapyError, InvalidJson, InvalidRequest, MethodNotAllowed
from capyctl.domain.requests import CancelCause, Phase, RequestRecord, check_caller_id
from capyctl.domain.streams import Chunk, Comment, Done, EngineFailure
from capyctl.services.chat import ChatService, read_target
from capyctl.services.context import caller_request_id

log = logging.getLogger("capyctl.chat")
_decode = msgspec.json.Decoder(dict[str, Any]).decode
_encode = msgspec.json.encode
_NO_STORE = (b"cache-control", b"no-store")
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), _NO_STORE, (b"x-accel-buffering", b"no")]
_DONE = b"data: [DONE]\n\n"
# Refusals a streaming client gets as an SSE error event rather than a JSON answer (SALT-2).
_STREAMED_REFUSALS = frozenset({"cache_salt_unsupported"})
Headers = list[tuple[bytes, bytes]]


def decode_body(body: bytes) -> dict[str, Any]:
    try:
        obj = _decode(body)
    except msgspec.ValidationError as exc:
        raise InvalidRequest("the request body must be a JSON object") from exc
    except msgspec.DecodeError as exc:
        raise InvalidJson(str(exc)) from exc
    if "return_hidden_states" in obj:
        raise InvalidRequest("'return_hidden_states' is not supported", param="return_hidden_states")
    return obj


class ChatHandler:
    def __init__(
        self, service: ChatService, api_keys: Callable[[], list[str]], max_body: int, stats: RequestStats
    ) -> None:
        self._service = service
        self._api_keys = api_keys
        self._max_body = max_body
        self._stats = stats

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        request_id = str(ULID())
        headers: Headers = [_NO_STORE, (b"x-capyctl-request-id", request_id.encode())]
        try:
            if scope["method"] != "POST":
                raise MethodNotAllowed(f"{scope['method']} is not allowed on /v1/chat/completions; use POST")
            check_bearer(header(scope, b"authorization"), self._api_keys())
            caller_values = header_values(scope, b"x-request-id")
            if caller_values:  # handed back as given, once it is known to be valid
                caller = check_caller_id(caller_values)
                headers.append((b"x-request-id", str(caller).encode()))
                caller_request_id.set(caller)
            obj = decode_body(await read_body(receive, scope, self._max_body))
            model, stream = read_target(obj)
        except ClientGone:
            return
        except CapyError as error:
            await send_json(send, status_of(error), error_body(error), headers)
            return
        record = RequestRecord(id=request_id, deployment=model, stream=stream)
        outcome: list[str | float | None] = ["client_gone", None]  # code, ttft_ms
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_disconnect, receive, tg.cancel_scope)
            if stream:
                await self._stream(record, obj, send, headers, outcome)
            else:
                await self._complete(record, obj, send, headers, outcome)
            tg.cancel_scope.cancel()
        if tg.cancel_scope.cancelled_caught and record.phase not in (Phase.DONE, Phase.FAILED):
            record.cancelled(CancelCause.CLIENT_GONE)
            log.info("request %s %s: client hung up, engine connection closed", request_id, model)
        if self._service.knows(model):  # unknown names must not become label values
            self._stats.answered(model, str(outcome[0]), outcome[1])  # type: ignore[arg-type]

    async def _complete(
        self, record: RequestRecord, obj: dict[str, Any], send: Any, headers: Headers, outcome: list
    ) -> None:
        try:
            answer = await self._service.complete(record, obj)
        except CapyError as error:
            record.phase = Phase.FAILED
            outcome[0] = error.code
            await send_json(send, status_of(error), error_body(error), headers)
            return
        record.phase = Phase.DONE
        outcome[:] = ["ok", answer["capyctl"]["metrics"].get("ttft_ms", {}).get("value")]
        await send_json(send, 200, _encode(answer), headers)

    async def _stream(
        self, record: RequestRecord, obj: dict[str, Any], send: Any, headers: Headers, outcome: list
    ) -> None:
        start = {"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS + headers[1:]}
        opened = started = False
        try:
            async with self._service.open(record, obj) as call:
                opened = True
                async for batch in call.events:
                    parts: list[bytes] = []
                    for event in batch:
                        if isinstance(event, Chunk | EngineFailure):
                            parts += (b"data: ", event.raw, b"\n\n")
                        elif isinstance(event, Done):
                            metrics = call.metrics()
                            outcome[1] = metrics.get("ttft_ms", {}).get("value")
                            parts += (b": x-capyctl-metrics ", _encode(metrics), b"\n\n", _DONE)
                        elif isinstance(event, Comment):
                            parts += (event.raw, b"\n\n")
                    if not started:  # headers go out with the first chunk: one wake-up for the client
                        began = time.perf_counter()
                        await send(start)
                        await send({"type": "http.response.body", "body": b"".join(parts), "more_body": True})
                        self._stats.relayed_first_chunk(record.deployment, time.perf_counter() - began)
                        started = True
                    else:
                        await send({"type": "http.response.body", "body": b"".join(parts), "more_body": True})
            record.phase = Phase.DONE
            outcome[0] = "ok"
        except CapyError as error:
            record.phase = Phase.FAILED
            outcome[0] = error.code
            if not started and not opened and error.code not in _STREAMED_REFUSALS:
                await send_json(send, status_of(error), error_body(error), headers)
                return
            if not started:  # the engine accepted the request: the client gets a stream with the error
                await send(start)
                started = True
            await send({"type": "http.response.body", "body": sse_error_event(error), "more_body": True})
        if not started:
            await send(start)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
