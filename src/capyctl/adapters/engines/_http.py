"""Engine side routes over httpx (health, metrics, version) and the reading of engine error answers.

Shared by every engine adapter. The streamed chat call itself is in ``_wire``.
"""

from __future__ import annotations

from typing import Any

import httpx
import msgspec

from capyctl.domain.errors import EngineError, EngineUnavailable, engine_code

_decode_any = msgspec.json.decode


def engine_error(status: int, body: bytes) -> EngineError:
    """Map an engine's error answer (OpenAI envelope, flat, or not JSON) to ``EngineError``."""
    try:
        obj: Any = _decode_any(body)
    except msgspec.DecodeError:
        obj = None
    if isinstance(obj, dict) and "detail" in obj and "error" not in obj:  # FastAPI's shape (SGLang's 422, a 404)
        return EngineError(status, _detail(obj["detail"]) or f"engine answered {status}", None, {})
    error = obj.get("error", obj) if isinstance(obj, dict) else None
    if not isinstance(error, dict):
        text = body.decode("utf-8", "replace").strip()[:500] or f"HTTP {status}"
        return EngineError(status, f"engine answered {status}: {text}", None, {})
    message = str(error.get("message") or f"engine answered {status}")
    extra = {k: v for k, v in error.items() if k not in ("message", "type", "code", "object")}
    return EngineError(status, message, engine_code(error), extra)


def _detail(detail: Any) -> str:
    """The reason in a FastAPI error: a string, or a list of {loc, msg} (validation errors)."""
    if isinstance(detail, str):
        return detail
    if isinstance(detail, list):
        parts = []
        for item in detail[:10]:
            if isinstance(item, dict) and isinstance(item.get("msg"), str):
                where = ".".join(str(p) for p in item.get("loc", ()) if p != "body")
                parts.append(f"{where}: {item['msg']}" if where else item["msg"])
        return "; ".join(parts)
    return ""


async def fetch_ok(client: httpx.AsyncClient, url: str) -> httpx.Response | None:
    """GET an engine's side route (health, metrics, version): the answer if it was 200, else None.

    Never raises for network trouble: an engine that does not answer is simply not ready.
    """
    try:
        response = await client.get(url, timeout=2.0)
    except httpx.HTTPError:
        return None
    except AttributeError as exc:  # httpcore over anyio asks a socket the engine closed mid-connect for its
        if "getpeername" not in str(exc):  # peer's address, and raises this rather than a ConnectError
            raise
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


async def post_ok(client: httpx.AsyncClient, url: str, body: Any = None, timeout: float = 900.0) -> None:
    """POST to an engine's control route (sleep, wake, release ...); raises ``EngineError`` with the engine's
    answer when it is not 200, ``EngineUnavailable`` when the engine cannot be reached."""
    try:
        response = await client.post(url, json=body, timeout=timeout)
    except httpx.HTTPError as exc:
        raise EngineUnavailable(f"{url}: {exc}") from exc
    if response.status_code != 200:
        raise engine_error(response.status_code, response.content)


def make_client() -> httpx.AsyncClient:
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=10.0, read=None, write=60.0, pool=None),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        trust_env=False,
    )
