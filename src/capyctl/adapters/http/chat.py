"""``POST /v1/chat/completions`` as a bare ASGI handler: the relay's hot path.

Per request: authenticate, give it a ULID, read and decode the body once,
then let ``ChatService`` drive the engine. While CapyCTL waits for or relays
the engine's answer, a watcher task listens for the client's hang-up and
cancels the scope that owns the engine connection, streamed or not. Before
a stream's 200 is sent, errors are JSON answers with their status; after it,
an error is one SSE error event and the stream ends.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import anyio
import msgspec
from ulid import ULID

from capyctl.adapters.http.asgi import ClientGone, Scope, header, read_body, send_json, watch_disconnect
from capyctl.adapters.http.errors import error_body, sse_error_event, status_of
from capyctl.domain.auth import check_bearer
from capyctl.domain.errors import CapyError, InvalidJson, InvalidRequest
from capyctl.domain.requests import CancelCause, Phase, RequestRecord
from capyctl.domain.streams import Chunk, Comment, Done, EngineFailure
from capyctl.services.chat import ChatService, read_target

log = logging.getLogger("capyctl.chat")
_decode = msgspec.json.Decoder(dict[str, Any]).decode
_encode = msgspec.json.encode
_NO_STORE = (b"cache-control", b"no-store")
_SSE_HEADERS = [(b"content-type", b"text/event-stream"), _NO_STORE, (b"x-accel-buffering", b"no")]
_DONE = b"data: [DONE]\n\n"
# Refusals a streaming client gets as an SSE error event rather than a JSON answer (SALT-2).
_STREAMED_REFUSALS = frozenset({"cache_salt_unsupported"})


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
    def __init__(self, service: ChatService, api_keys: Callable[[], list[str]], max_body: int) -> None:
        self._service = service
        self._api_keys = api_keys
        self._max_body = max_body

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        request_id = str(ULID())
        headers = [_NO_STORE, (b"x-capyctl-request-id", request_id.encode())]
        try:
            if scope["method"] != "POST":
                raise InvalidRequest("use POST for /v1/chat/completions")
            check_bearer(header(scope, b"authorization"), self._api_keys())
            obj = decode_body(await read_body(receive, scope, self._max_body))
            model, stream = read_target(obj)
        except ClientGone:
            return
        except CapyError as error:
            await send_json(send, status_of(error), error_body(error), headers)
            return
        record = RequestRecord(id=request_id, deployment=model, stream=stream)
        async with anyio.create_task_group() as tg:
            tg.start_soon(watch_disconnect, receive, tg.cancel_scope)
            if stream:
                await self._stream(record, obj, send, headers)
            else:
                await self._complete(record, obj, send, headers)
            tg.cancel_scope.cancel()
        if tg.cancel_scope.cancelled_caught and record.phase not in (Phase.DONE, Phase.FAILED):
            record.cancelled(CancelCause.CLIENT_GONE)
            log.info("request %s %s: client hung up, engine connection closed", request_id, model)

    async def _complete(self, record: RequestRecord, obj: dict[str, Any], send: Any, headers: list) -> None:
        try:
            answer = await self._service.complete(record, obj)
        except CapyError as error:
            record.phase = Phase.FAILED
            await send_json(send, status_of(error), error_body(error), headers)
            return
        record.phase = Phase.DONE
        await send_json(send, 200, _encode(answer), headers)

    async def _stream(self, record: RequestRecord, obj: dict[str, Any], send: Any, headers: list) -> None:
        started = False
        try:
            async with self._service.open(record, obj) as call:
                await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS + headers[1:]})
                started = True
                async for event in call.events:
                    if isinstance(event, Chunk):
                        body = b"data: " + event.raw + b"\n\n"
                    elif isinstance(event, Done):
                        body = b": x-capyctl-metrics " + _encode(call.metrics()) + b"\n\n" + _DONE
                    elif isinstance(event, EngineFailure):
                        body = b"data: " + event.raw + b"\n\n"
                    elif isinstance(event, Comment):
                        body = event.raw + b"\n\n"
                    await send({"type": "http.response.body", "body": body, "more_body": True})
            record.phase = Phase.DONE
        except CapyError as error:
            record.phase = Phase.FAILED
            if not started and error.code in _STREAMED_REFUSALS:
                await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS + headers[1:]})
                started = True
            if not started:
                await send_json(send, status_of(error), error_body(error), headers)
                return
            await send({"type": "http.response.body", "body": sse_error_event(error), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
