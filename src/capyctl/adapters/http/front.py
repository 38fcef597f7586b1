"""The front door every API's requests go through, written once: chat and decisions both use it.

Per request: a ULID, the method, the API key (its scope, salt and daily
limit), the caller's X-Request-Id, X-LLM-Wait, the body decoded once, then the
endpoint for the path answers. While it waits for or relays the engine's
answer, the exchange watches for the client's hang-up (the connection's loss,
at once) and for the deadline (a timer), and cancels the scope that owns the
engine connection, streamed or not. A request cut that way is settled and
counted; whatever breaks inside CapyCTL is answered by the last resort with
the request ID, never a bare 500 or a dropped connection.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import msgspec

from capyctl.adapters.http.errors import error_body, retry_after, sse_error_event, status_of
from capyctl.adapters.http.exchange import Exchange, find_header, header_values
from capyctl.adapters.http.ids import new_request_id
from capyctl.adapters.http.prometheus import RequestStats
from capyctl.adapters.http.request_rows import broken_row, finished_row, refused_row
from capyctl.domain.errors import (
    CapyError,
    DeadlineExceeded,
    HostLost,
    InternalError,
    InvalidJson,
    InvalidRequest,
    MethodNotAllowed,
    StreamIdleTimeout,
)
from capyctl.domain.keys import ApiKey, bind_salt, check_scope
from capyctl.domain.requests import CancelCause, Phase, RequestRecord, check_caller_id
from capyctl.services.context import caller_request_id
from capyctl.services.keys import Keyring
from capyctl.services.request_log import RequestLog
from capyctl.services.requests import Call, RequestService

log = logging.getLogger("capyctl.chat")
_decode = msgspec.json.Decoder(dict[str, Any]).decode
_encode = msgspec.json.encode
NO_STORE = (b"cache-control", b"no-store")
# Answers that refused a request before any engine saw it, counted in capyctl_refusals_total.
_REFUSALS = frozenset(
    {
        "daily_limit",
        "model_not_found",
        "deployment_stopped",
        "api_mismatch",
        "cache_salt_unsupported",
        "invalid_request",
        "invalid_json",
        "queue_full",
        "model_loading",
        "queued",
        "device_busy",
        "insufficient_memory",
        "not_placed",
        "gpu-busy",
    }
)
Headers = list[tuple[bytes, bytes]]


def llm_wait(values: list[str]) -> float | None:
    """X-LLM-Wait (LIFE-4): whole seconds from 0 to 900 this request may wait for a model; None without it."""
    if not values:
        return None
    if len(values) > 1 or not values[0].strip().isdigit() or int(values[0]) > 900:
        raise InvalidRequest("X-LLM-Wait must be given once, as whole seconds from 0 to 900", param="X-LLM-Wait")
    return float(int(values[0]))


def decode_body(body: bytes) -> dict[str, Any]:
    try:
        obj = _decode(body)
    except msgspec.ValidationError as exc:
        raise InvalidRequest("the request body must be a JSON object") from exc
    except msgspec.DecodeError as exc:
        raise InvalidJson(str(exc)) from exc
    except RecursionError as exc:
        raise InvalidJson("JSON nested too deeply (CapyCTL decodes up to several hundred levels)") from exc
    return obj


_TIMEOUTS: dict[CancelCause | None, Callable[[RequestRecord], CapyError]] = {
    CancelCause.DEADLINE: lambda record: DeadlineExceeded(
        f"no answer from the engine serving {record.deployment!r} within the request deadline; "
        "the request was cut and the engine told to stop",
        model=record.deployment,
    ),
    CancelCause.IDLE: lambda record: StreamIdleTimeout(
        f"the answer from {record.deployment!r} went silent for longer than the stream idle timeout; "
        "the request was cut and the engine told to stop",
        model=record.deployment,
    ),
    CancelCause.HOST_LOST: lambda record: HostLost(record.deployment, record.instance),
}


async def send_one_answer(answering: Awaitable[dict[str, Any]], request: Request) -> None:
    """A whole answer as one JSON body (a non-streamed chat answer, a decision), or its error with its status."""
    exchange, headers = request.exchange, request.headers
    try:
        answer = await answering
    except CapyError as error:
        request.phase = Phase.FAILED
        request.code, request.status = error.code, status_of(error)
        await exchange.json(request.status, error_body(error), headers + retry_after(error))
        return
    request.phase = Phase.DONE
    request.code = "ok"
    request.measured(answer["capyctl"]["metrics"], answer.get("usage"))
    await exchange.json(200, _encode(answer), headers)


class Endpoint(Protocol):
    """One API behind the front door: how it reads its target, and how it answers."""

    path: str
    service: RequestService

    def target(self, obj: dict[str, Any]) -> tuple[str, bool]:
        """The model named and whether the client wants a stream; raises for what cannot be served."""

    def start(self, request: Request) -> None:
        """What can be done for the request at once, before its task runs (never raises: an error is kept on
        the request for ``answer``); whatever the request still holds once answered, its ``close`` gives
        back."""

    async def answer(self, request: Request) -> None: ...

    async def late_error(self, error: CapyError, request: Request) -> None: ...


class Request(Call, kw_only=True):
    """A call (``services.requests.Call``) as the front door serves it: the exchange it came on, the endpoint
    that answers it, and the headers every answer to it carries (its request IDs)."""

    exchange: Exchange
    endpoint: Endpoint
    headers: Headers


class FrontDoor:
    """What every API's requests go through, written once: the ULID, the method, the key (its scope, salt
    and daily limit), the caller's X-Request-Id, X-LLM-Wait, the body limit and its decoding, the hang-up
    and deadline watcher, the cut requests' settlement and the outcome counters. The endpoint for the
    path does the rest."""

    def __init__(
        self,
        endpoints: list[Endpoint],
        keys: Keyring,
        max_body: int,
        stats: RequestStats,
        records: RequestLog | None = None,
    ) -> None:
        self.endpoints = {endpoint.path: endpoint for endpoint in endpoints}
        self._keys = keys
        self._max_body = max_body
        self._stats = stats
        self._records = records  # each request's row, as it ends (appended to a buffer: no I/O here)

    def serve(self, exchange: Exchange) -> Awaitable[None]:
        """The request's front, done at once as its last byte arrives (the checks, then the endpoint's
        ``start``: the engine write where nothing has to wait), before its task first runs; returns the rest,
        for that task. Errors of the front are answered by it; whatever breaks inside CapyCTL, here or later,
        gets the last resort's answer with the request ID."""
        request_id = new_request_id()
        headers: Headers = [NO_STORE, (b"x-capyctl-request-id", request_id.encode())]
        named: list[str] = []  # the key's name and the model, as far as the front read them (for a refusal's row)
        try:
            request = self._front(exchange, request_id, headers, named)
        except CapyError as error:
            self._stats.refused(error.code)
            if self._records is not None:
                row = refused_row(request_id, error, exchange.path, self._records.wall(), *_key_and_model(named))
                self._records.add(row)
            return exchange.json(status_of(error), error_body(error), headers + retry_after(error) + _allow(error))
        except Exception:
            log.exception("request %s: internal error", request_id)
            if self._records is not None:
                row = broken_row(request_id, exchange.path, self._records.wall(), False, *_key_and_model(named))
                self._records.add(row)
            return internal_error(exchange, request_id, headers)
        return self._last_resort(request)

    async def _last_resort(self, request: Request) -> None:
        exchange = request.exchange
        try:
            await self._answer(request)
        except Exception:  # the last resort: whatever broke inside CapyCTL, the client gets an answer
            log.exception("request %s: internal error", request.id)
            if self._records is not None:
                row = broken_row(
                    request.id,
                    exchange.path,
                    self._records.wall(),
                    exchange.started,
                    request.key,
                    request.deployment,
                    request.stream,
                )
                self._records.add(row)
            await internal_error(exchange, request.id, request.headers)
        finally:
            request.close()

    def _key(self, exchange: Exchange, endpoint: Endpoint) -> ApiKey:
        """The first checks: the method, then the key."""
        if exchange.method != "POST":
            raise MethodNotAllowed(f"{exchange.method} is not allowed on {endpoint.path}; use POST")
        return self._keys.authenticate(find_header(exchange.headers, b"authorization"))

    def _body(
        self, endpoint: Endpoint, key: ApiKey, body: bytes, request_id: str, named: list[str]
    ) -> tuple[dict[str, Any], str, bool]:
        """The body decoded and its target read (into ``named``), the key's scope and salt applied, and the key's
        place for the day taken (``let_in``, last: given back by the request's ``close``)."""
        obj = decode_body(body)
        model, stream = endpoint.target(obj)
        named.append(model)
        check_scope(key, model, endpoint.service.names)
        bind_salt(key, obj)
        self._keys.let_in(key, request_id)
        return obj, model, stream

    def _front(self, exchange: Exchange, request_id: str, headers: Headers, named: list[str]) -> Request:
        """The checks of the front, in order, then the endpoint's ``start``; raises what is to be answered.
        ``named`` gets the key's name once it is known, then the model's."""
        endpoint = self.endpoints[exchange.path]
        key = self._key(exchange, endpoint)
        named.append(key.name)
        caller_values = header_values(exchange.headers, b"x-request-id")
        if caller_values:  # handed back as given, once it is known to be valid
            caller = check_caller_id(caller_values)
            headers.append((b"x-request-id", str(caller).encode()))
            caller_request_id.set(caller)  # (the request's task runs in the context this runs in)
        wait = llm_wait(header_values(exchange.headers, b"x-llm-wait"))
        obj, model, stream = self._body(endpoint, key, exchange.body, request_id, named)
        request = Request(
            id=request_id,
            deployment=model,
            stream=stream,
            key=key.name,
            salt_bound=key.cache_salt is not None,
            obj=obj,
            wait=wait,
            received_at=endpoint.service.now(),
            keyring=self._keys,
            exchange=exchange,
            endpoint=endpoint,
            headers=headers,
        )
        try:
            endpoint.start(request)
        except BaseException:
            request.close()
            raise
        return request

    async def _answer(self, request: Request) -> None:
        exchange, endpoint = request.exchange, request.endpoint
        service, model = endpoint.service, request.deployment
        with exchange.cut_scope() as cut:
            exchange.watch(cut.cancel, service.check_every, functools.partial(service.overdue, request))
            try:
                await endpoint.answer(request)
            finally:
                exchange.unwatch()
                request.close()
        if cut.cancelled_caught and request.phase not in (Phase.DONE, Phase.FAILED):
            if request.cause in _TIMEOUTS:  # cut by CapyCTL, the client is still there: tell it why
                error = _TIMEOUTS[request.cause](request)
                request.code = error.code
                await endpoint.late_error(error, request)
            else:
                request.cancelled(CancelCause.CLIENT_GONE)
            service.cut(request)
            log.info("request %s %s: %s, engine connection closed", request.id, model, request.cause)
        if service.knows(model):  # unknown names must not become label values
            self._stats.answered(model, request.code, request.ttft_ms, request.key or "-")
        if request.code in _REFUSALS:
            self._stats.refused(request.code)
        if self._records is not None:
            took_ms = (service.now() - request.received_at) * 1000
            self._records.add(finished_row(request, endpoint.path, self._records.wall(), took_ms))


def _key_and_model(named: list[str]) -> tuple[str | None, str | None]:
    """The key's name and the model, as far as the front read them."""
    return (named[0] if named else None), (named[1] if len(named) > 1 else None)


def _allow(error: CapyError) -> list[tuple[bytes, bytes]]:
    """A 405's ``Allow`` header (RFC 9110): the front door's paths take POST only."""
    return [(b"allow", b"POST")] if isinstance(error, MethodNotAllowed) else []


async def internal_error(exchange: Exchange, request_id: str, headers: Headers) -> None:
    """The last resort's answer: before the status line went out, the JSON error answer; during a stream,
    an SSE error event that ends it."""
    error = InternalError(request_id)
    if not exchange.started:
        await exchange.json(status_of(error), error_body(error), headers)
    elif not exchange.ended:
        await exchange.end(sse_error_event(error))
