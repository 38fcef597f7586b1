"""The CLI's client for the management API of a running CapyCTL."""

from __future__ import annotations

from http.client import HTTPConnection, HTTPException
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import msgspec

from capyctl.adapters.storage.state_dir import StateDir
from capyctl.domain.errors import CapyError


class ServerNotRunning(CapyError):
    code = "server_not_running"


class ServerError(CapyError):
    """An error answer of the management API, with its code."""

    def __init__(self, code: str, message: str, extra: dict[str, Any]) -> None:
        super().__init__(message, **extra)
        self.code = code


class ManagementClient:
    """Calls of the management API, one connection each, on the standard library's ``http.client``: the API is
    plain HTTP on loopback (the server writes an ``http://`` URL), and a whole HTTP client library (httpx with
    httpcore) would cost every command about 85 ms of imports, more than the call itself."""

    def __init__(self, state_dir: Path, timeout: float = 120.0) -> None:
        state = StateDir(state_dir)
        info = state.read_management()
        token = state.read_admin_token()
        if not info or not token:
            raise ServerNotRunning(
                f"no CapyCTL server is running for the state directory {state_dir}; "
                "start one with: capyctl start standalone"
            )
        self._state_dir = state_dir
        self._url = str(info["url"])
        where = urlsplit(self._url)
        if where.scheme != "http" or not where.hostname:
            raise ServerNotRunning(
                f"{state_dir}/management.json names {self._url!r}, not the http:// address a CapyCTL server writes; "
                "start the server again for this state directory"
            )
        self._host, self._port = where.hostname, where.port or 80
        self._headers = {"authorization": f"Bearer {token}", "accept": "application/json"}
        self._timeout = timeout

    def call(self, method: str, path: str, json: Any = None, params: dict[str, Any] | None = None) -> Any:
        """The answer's JSON body; raises ServerNotRunning where the server cannot be reached, ServerError (with
        the API's error code) for an error answer."""
        query = urlencode({k: v for k, v in (params or {}).items() if v is not None})
        target = quote(path, safe="/") + (f"?{query}" if query else "")
        headers = dict(self._headers)
        body = None
        if json is not None:
            body = msgspec.json.encode(json)
            headers["content-type"] = "application/json"
        connection = HTTPConnection(self._host, self._port, timeout=self._timeout)
        try:
            connection.request(method, target, body=body, headers=headers)
            response = connection.getresponse()
            status, raw = response.status, response.read()
        except (OSError, HTTPException) as exc:
            raise ServerNotRunning(
                f"cannot reach the CapyCTL management API at {self._url} ({exc.__class__.__name__}); "
                "is `capyctl start standalone` running for this state directory?"
            ) from exc
        finally:
            connection.close()
        try:
            answer = msgspec.json.decode(raw) if raw else None
        except msgspec.DecodeError:
            answer = None
        if status >= 400:
            error = (answer or {}).get("error", {}) if isinstance(answer, dict) else {}
            extra = {k: v for k, v in error.items() if k not in ("message", "type", "code")}
            raise ServerError(
                str(error.get("code", f"http_{status}")),
                str(error.get("message", raw[:300].decode("utf-8", "replace"))),
                extra,
            )
        return answer
