"""ASGI helpers: request IDs and a last resort for the routes served through Litestar."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from capyctl.adapters.http.errors import error_body, sse_error_event, status_of
from capyctl.adapters.http.ids import new_request_id
from capyctl.domain.errors import InternalError

Scope = dict[str, Any]
Message = dict[str, Any]
Headers = list[tuple[bytes, bytes]]
REQUEST_ID_KEY = "capyctl_request_id"  # the scope key under which with_request_ids keeps the ID
log = logging.getLogger("capyctl.http")


async def send_json(send: Any, status: int, body: bytes, headers: list[tuple[bytes, bytes]]) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class Reply:
    """The ASGI ``send`` of one request, remembering how far the answer got.

    The last-resort handler reads it: before the status line went out the
    client gets a JSON error answer; during a stream, an SSE error event.
    """

    __slots__ = ("raw", "started", "ended")

    def __init__(self, send: Any) -> None:
        self.raw = send  # for the body chunks of a stream, once its start went through here
        self.started = False
        self.ended = False

    async def __call__(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.started = True
        elif not message.get("more_body", False):
            self.ended = True
        await self.raw(message)

    async def internal_error(self, request_id: str, headers: Headers) -> None:
        error = InternalError(request_id)
        if not self.started:
            await send_json(self, status_of(error), error_body(error), headers)
        elif not self.ended:
            await self({"type": "http.response.body", "body": sse_error_event(error), "more_body": False})


def with_request_ids(app: Callable[..., Any]) -> Callable[..., Any]:
    """Give every HTTP request an ID (``X-CapyCTL-Request-Id`` on its answer) and a last resort.

    The ID is kept in the scope under ``REQUEST_ID_KEY`` for error handlers and
    logs. Whatever escapes ``app`` is logged with its traceback under that ID
    and answered with the ``internal_error`` envelope, never a bare 500 or a
    dropped connection.
    """

    async def wrapped(scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        request_id = new_request_id()
        scope[REQUEST_ID_KEY] = request_id
        header = (b"x-capyctl-request-id", request_id.encode())

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        reply = Reply(send_with_id)
        try:
            await app(scope, receive, reply)
        except Exception:
            log.exception("request %s: internal error on %s %s", request_id, scope.get("method"), scope.get("path"))
            await reply.internal_error(request_id, [(b"cache-control", b"no-store")])

    return wrapped
