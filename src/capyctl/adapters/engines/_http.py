"""HTTP session to OpenAI-compatible engines (shared by every engine adapter)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import msgspec

from capyctl.adapters.engines._sse import SseParser
from capyctl.domain.errors import EngineError, EngineUnavailable
from capyctl.domain.ports import EngineSession
from capyctl.domain.streams import StreamEvent

_MAX_ERROR_BODY = 64 * 1024
_decode_any = msgspec.json.decode


def engine_error(status: int, body: bytes) -> EngineError:
    """Map an engine's error answer (OpenAI envelope, flat, or not JSON) to ``EngineError``."""
    try:
        obj: Any = _decode_any(body)
    except msgspec.DecodeError:
        obj = None
    error = obj.get("error", obj) if isinstance(obj, dict) else None
    if not isinstance(error, dict):
        text = body.decode("utf-8", "replace").strip()[:500] or f"HTTP {status}"
        return EngineError(status, f"engine answered {status}: {text}", None, {})
    message = str(error.get("message") or f"engine answered {status}")
    code = error.get("code")
    etype = error.get("type")
    name = etype if isinstance(etype, str) and etype else (code if isinstance(code, str) else None)
    extra = {k: v for k, v in error.items() if k not in ("message", "type", "code", "object")}
    return EngineError(status, message, name, extra)


async def fetch_ok(client: httpx.AsyncClient, url: str) -> httpx.Response | None:
    """GET an engine's side route (health, metrics, version): the answer if it was 200, else None.

    Never raises for network trouble: an engine that does not answer is simply not ready.
    """
    try:
        response = await client.get(url, timeout=2.0)
    except httpx.HTTPError:
        return None
    return response if response.status_code == 200 else None


async def fetch_json(client: httpx.AsyncClient, url: str) -> dict[str, Any] | None:
    response = await fetch_ok(client, url)
    if response is None:
        return None
    try:
        body = response.json()
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def make_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=10.0, read=None, write=60.0, pool=None),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        trust_env=False,
    )


class HttpxEngineSession(EngineSession):
    def __init__(self, client: httpx.AsyncClient) -> None:
        self._client = client

    @asynccontextmanager
    async def chat_stream(self, base_url: str, body: bytes) -> AsyncIterator[AsyncIterator[list[StreamEvent]]]:
        request = self._client.build_request(
            "POST",
            base_url + "/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json", "accept": "text/event-stream"},
        )
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise EngineUnavailable(f"could not reach the engine at {base_url}: {exc!r}") from exc
        try:
            if response.status_code != 200:
                raw = b""
                async for part in response.aiter_raw():
                    raw += part
                    if len(raw) > _MAX_ERROR_BODY:
                        break
                raise engine_error(response.status_code, raw)
            yield _events(response)
        finally:
            # Shielded: under cancellation (client gone) an unshielded close can be cut
            # short, leaving the socket open and the engine generating until GC.
            with anyio.CancelScope(shield=True):
                await response.aclose()


async def _events(response: httpx.Response) -> AsyncIterator[list[StreamEvent]]:
    """The engine's events, one batch per network read (so the relay writes once per read)."""
    parser = SseParser()
    try:
        async for data in response.aiter_raw():
            batch = list(parser.feed(data))
            if batch:
                yield batch
    except httpx.HTTPError as exc:
        raise EngineUnavailable(f"the engine connection broke: {exc!r}") from exc
    if last := list(parser.close()):
        yield last
