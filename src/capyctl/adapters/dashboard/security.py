"""What every dashboard answer goes through: the Host check (DNS rebinding) and the security headers.

A page on another site that makes a browser resolve its own name to
127.0.0.1 reaches this listener with that name in ``Host``: such a request
is refused before any handler sees it (421). Every answer, error pages and
static files included, carries a Content-Security-Policy that allows
scripts, styles and connections from this origin only and no inline script,
and says never to frame the page nor to send a Referer (a sign-in link must
not leak through one).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import msgspec

CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
       "form-action 'self'; frame-ancestors 'none'; base-uri 'none'")
HEADERS: list[tuple[bytes, bytes]] = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"cross-origin-resource-policy", b"same-origin"),
]
PREFIX = "/ui"  # the dashboard's paths; "/" sends a browser there


def served_hosts(host: str, port: int) -> frozenset[str]:
    """The ``Host`` values a browser sends for this listener: loopback by address or name, and the configured
    host (an IPv6 one in brackets)."""
    names = {"127.0.0.1", "localhost", "[::1]"}
    if host not in ("", "0.0.0.0", "::"):
        names.add(f"[{host}]" if ":" in host else host)
    return frozenset(f"{name}:{port}".lower() for name in names)


def is_dashboard(path: str) -> bool:
    return path == "/" or path == PREFIX or path.startswith(PREFIX + "/")


def guarded(app: Callable[..., Any], hosts: Iterable[str]) -> Callable[..., Any]:
    """``app`` behind the Host check, with the security headers on every answer."""
    allowed = frozenset(hosts)

    async def wrapped(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        host = next((v.decode("latin-1").lower() for k, v in scope["headers"] if k == b"host"), "")
        if host not in allowed:
            await _refuse_host(send, host, allowed)
            return

        async def with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *HEADERS]}
            await send(message)

        await app(scope, receive, with_headers)

    return wrapped


async def _refuse_host(send: Any, host: str, allowed: frozenset[str]) -> None:
    body = msgspec.json.encode({"error": {
        "code": "wrong_host", "type": "invalid_request_error",
        "message": f"the Host header {host!r} is not one this listener serves; open the dashboard as "
                   f"http://{sorted(allowed)[0]}/ (a name that only resolves here is refused against DNS rebinding)",
    }})
    await send({"type": "http.response.start", "status": 421, "headers": [
        (b"content-type", b"application/json"), (b"content-length", b"%d" % len(body)), (b"cache-control", b"no-store"),
        *HEADERS]})
    await send({"type": "http.response.body", "body": body})


def mount(management: Callable[..., Any], dashboard: Callable[..., Any]) -> Callable[..., Any]:
    """One listener for both: the dashboard's paths (``/`` and ``/ui/...``) to the dashboard, every other
    path to the management API, untouched (its admin token works exactly as without the dashboard)."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and is_dashboard(scope.get("path", "")):
            await dashboard(scope, receive, send)
        else:
            await management(scope, receive, send)

    return app
