"""Small ASGI helpers for the hot path (no framework between client and engine)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio

from capyctl.domain.errors import TooLarge

Scope = dict[str, Any]
Message = dict[str, Any]


class ClientGone(Exception):
    """The client hung up before CapyCTL answered."""


def header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def header_values(scope: Scope, name: bytes) -> list[str]:
    return [value.decode("latin-1") for key, value in scope["headers"] if key == name]


async def read_body(receive: Any, scope: Scope, limit: int) -> bytes:
    """The whole request body; ``TooLarge`` as soon as it passes ``limit`` bytes."""
    declared = header(scope, b"content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TooLarge(limit)
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone()
        body = message.get("body", b"")
        size += len(body)
        if size > limit:
            raise TooLarge(limit)
        parts.append(body)
        if not message.get("more_body", False):
            return b"".join(parts)


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


async def watch(receive: Any, scope: anyio.CancelScope, overdue: Callable[[], bool], every: float) -> None:
    """Cancel ``scope`` when the client hangs up or ``overdue()`` says so (asked every ``every`` s).

    One task per request does both: the request body was read already, so the
    only message ``receive`` can still bring is the client's disconnect.
    """
    while True:
        with anyio.move_on_after(every):
            if (await receive())["type"] == "http.disconnect":
                break
        if overdue():
            break
    scope.cancel()
