"""The CLI's client for the management API of a running CapyCTL."""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any

import httpx

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
        self._client = httpx.Client(
            base_url=str(info["url"]),
            headers={"authorization": f"Bearer {token}"},
            timeout=timeout,
            trust_env=False,
            # The management API is plain HTTP on loopback (the server writes an http:// URL): httpx's default
            # context would load a CA bundle for nothing (about 15 ms of every command). This one trusts no CA, so
            # an https URL would be refused, never trusted unchecked.
            verify=ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT),
        )

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        try:
            response = self._client.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            raise ServerNotRunning(
                f"cannot reach the CapyCTL management API at {self._client.base_url} ({exc.__class__.__name__}); "
                "is `capyctl start standalone` running for this state directory?"
            ) from exc
        try:
            body = response.json()
        except ValueError:
            body = None
        if response.status_code >= 400:
            error = (body or {}).get("error", {}) if isinstance(body, dict) else {}
            extra = {k: v for k, v in error.items() if k not in ("message", "type", "code")}
            raise ServerError(
                str(error.get("code", f"http_{response.status_code}")),
                str(error.get("message", response.text[:300])),
                extra,
            )
        return body
