"""What every dashboard answer goes through: the Host check (DNS rebinding) and the security headers.

A page on another site that makes a browser resolve its own name to
127.0.0.1 reaches this listener with that name in ``Host``: such a request
is refused before any handler sees it (421). Only IP addresses (which no
DNS answer can rebind), ``localhost`` and the configured address pass, with
the listener's port. Every answer, error pages and
static files included, carries a Content-Security-Policy that allows
scripts, styles and connections from this origin only and no inline script,
and says never to frame the page nor to send a Referer (a sign-in link must
not leak through one).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from typing import Any

import msgspec

CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
    "form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
)
HEADERS: list[tuple[bytes, bytes]] = [
    (b"content-security-policy", CSP.encode()),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
    (b"x-frame-options", b"DENY"),
    (b"cross-origin-opener-policy", b"same-origin"),
    (b"cross-origin-resource-policy", b"same-origin"),
]
PREFIX = "/ui"  # the dashboard's paths; "/" sends a browser there
ICON = "/favicon.ico"


def served_names(host: str) -> frozenset[str]:
    """The host names a browser may use for this listener besides IP addresses: localhost and the
    configured one."""
    names = {"localhost"}
    if host not in ("", "0.0.0.0", "::"):
        names.add(f"[{host}]" if ":" in host else host.lower())
    return frozenset(names)


def host_ok(header: str, port: int, names: frozenset[str]) -> bool:
    """Whether ``Host`` names this listener: its port, and an IP address (which no DNS answer can rebind)
    or one of ``names``."""
    host, colon, given_port = header.lower().rpartition(":")
    if not colon or given_port != str(port):
        return False
    if host in names:
        return True
    literal = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        ipaddress.ip_address(literal)
    except ValueError:
        return False
    return True


def is_dashboard(path: str, headers: list[tuple[bytes, bytes]]) -> bool:
    """``/ui`` and below, and ``/favicon.ico`` (which browsers ask for on their own); ``/`` only for a
    browser (it accepts HTML): any other client gets the management API's own answer there, as before the
    dashboard."""
    if path == "/":
        return any(k == b"accept" and b"text/html" in v for k, v in headers)
    return path in (PREFIX, ICON) or path.startswith(PREFIX + "/")


def guarded(app: Callable[..., Any], port: int, names: frozenset[str]) -> Callable[..., Any]:
    """``app`` behind the Host check, with the security headers on every answer."""

    async def wrapped(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        host = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"host"), "")
        if not host_ok(host, port, names):
            await _refuse_host(send, host, port)
            return

        async def with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *HEADERS]}
            await send(message)

        await app(scope, receive, with_headers)

    return wrapped


async def _refuse_host(send: Any, host: str, port: int) -> None:
    body = msgspec.json.encode(
        {
            "error": {
                "code": "wrong_host",
                "type": "invalid_request_error",
                "message": f"the Host header {host!r} is not one this listener serves; open the dashboard as "
                f"http://127.0.0.1:{port}/ (a name that is neither localhost, the configured address nor an IP "
                "address is refused, against DNS rebinding)",
            }
        }
    )
    await send(
        {
            "type": "http.response.start",
            "status": 421,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", b"%d" % len(body)),
                (b"cache-control", b"no-store"),
                *HEADERS,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def mount(management: Callable[..., Any], dashboard: Callable[..., Any]) -> Callable[..., Any]:
    """One listener for both: the dashboard's paths (``/ui/...``, and ``/`` for a browser) to the dashboard,
    every other request to the management API, untouched (its admin token works exactly as before)."""

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and is_dashboard(scope.get("path", ""), scope["headers"]):
            await dashboard(scope, receive, send)
        else:
            await management(scope, receive, send)

    return app
