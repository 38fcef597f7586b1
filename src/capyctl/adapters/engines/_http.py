"""Engine side routes (health, metrics, version, park and wake) and the reading of engine error answers.

Shared by every engine adapter. They reach an engine through ``EngineClient``,
which ``_wire.WireEngineSession`` is: the client that streams chats and asks
for decisions makes these calls too, over the same kept-alive connections.
"""

from __future__ import annotations

from typing import Any, Protocol

import msgspec

from capyctl.domain.errors import EdgeError, EngineError, EngineUnavailable, engine_code

PROBE_TIMEOUT = 2.0  # seconds for a side route's whole answer (health, metrics, version)
CONTROL_TIMEOUT = 900.0  # seconds for a park or wake: a deep wake reads the weights again


class EngineClient(Protocol):
    """The one HTTP client to engines, as the adapters' side routes use it."""

    async def request(
        self, method: str, url: str, body: bytes | None = None, timeout: float | None = 10.0
    ) -> tuple[int, bytes]:
        """``method`` on ``url`` (absolute), ``body`` sent as JSON: the status and whole body, whatever the
        status. Raises ``EngineUnavailable`` when the engine cannot be reached, breaks the connection before
        its answer ends or does not answer within ``timeout`` seconds, ``EdgeError`` for an answer too large
        to hold; a request cut short (timeout, cancellation) closes its connection."""
        ...


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


async def fetch_ok(client: EngineClient, url: str) -> bytes | None:
    """GET an engine's side route (health, metrics, version): the answer's body if it was 200, else None.

    Never raises for network trouble: an engine that does not answer (in ``PROBE_TIMEOUT``, or whole, or
    within the client's size limit) is simply not ready.
    """
    try:
        status, body = await client.request("GET", url, timeout=PROBE_TIMEOUT)
    except (EngineUnavailable, EdgeError):
        return None
    return body if status == 200 else None


async def fetch_json(client: EngineClient, url: str) -> dict[str, Any] | None:
    """``fetch_ok``'s answer when it is a JSON object; None for anything else."""
    body = await fetch_ok(client, url)
    if body is None:
        return None
    try:
        obj = _decode_any(body)
    except msgspec.DecodeError:
        return None
    return obj if isinstance(obj, dict) else None


async def post_ok(client: EngineClient, url: str, body: Any = None, timeout: float = CONTROL_TIMEOUT) -> None:
    """POST to an engine's control route (sleep, wake, release ...), ``body`` as JSON (None: no body); raises
    ``EngineError`` with the engine's answer when it is not 200, ``EngineUnavailable`` when the engine cannot
    be reached or does not answer in ``timeout`` seconds."""
    data = None if body is None else msgspec.json.encode(body)
    try:
        status, answer = await client.request("POST", url, data, timeout)
    except EngineUnavailable as exc:
        raise EngineUnavailable(f"{url}: {exc.message}") from exc
    if status != 200:
        raise engine_error(status, answer)
