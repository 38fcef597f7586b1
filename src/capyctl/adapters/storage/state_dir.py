"""The state directory: where CapyCTL keeps its key, admin token, database and logs.

Layout::

    <state>/identity/credentials     api_key: <key>          (0600, directory 0700): the key named default
    <state>/identity/admin-token     management API token    (0600)
    <state>/management.json          where the management API listens
    <state>/capyctl.db               SQLite: engines, deployments, events, API key digests
    <state>/logs/<deployment>/...    one log file per engine launch
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import msgspec

CREDENTIALS = "identity/credentials"
ADMIN_TOKEN = "identity/admin-token"
MANAGEMENT = "management.json"


def resolve_state_dir(explicit: str | None) -> Path:
    """--state-dir, else $CAPYCTL_STATE_DIR, else $XDG_STATE_HOME/capyctl, else ~/.local/state/capyctl."""
    if explicit:
        return Path(explicit).expanduser().resolve()
    if env := os.environ.get("CAPYCTL_STATE_DIR"):
        return Path(env).expanduser().resolve()
    if xdg := os.environ.get("XDG_STATE_HOME"):
        return Path(xdg).expanduser().resolve() / "capyctl"
    return Path.home() / ".local" / "state" / "capyctl"


def _write_secret(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(path.parent, 0o700)
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


class StateDir:
    def __init__(self, root: Path) -> None:
        self.root = root

    def prepare(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        (self.root / "logs").mkdir(exist_ok=True)

    @property
    def database(self) -> Path:
        return self.root / "capyctl.db"

    def log_dir(self, deployment: str) -> Path:
        return self.root / "logs" / deployment

    def read_api_key(self) -> str | None:
        """The key in identity/credentials (the key named ``default``), None when there is none."""
        path = self.root / CREDENTIALS
        if path.exists():
            for line in path.read_text().splitlines():
                if line.startswith("api_key: ") and line[9:].strip():
                    return line[9:].strip()
        return None

    def write_api_key(self, key: str) -> None:
        """Write the first start's key (ID-1), in the form the seed's ``sed`` one-liner reads."""
        _write_secret(self.root / CREDENTIALS, f"api_key: {key}\n")

    def forget_api_key(self) -> None:
        """The key named default was revoked: its line goes, a note says what to do instead."""
        if (self.root / CREDENTIALS).exists():
            _write_secret(
                self.root / CREDENTIALS,
                "# the key named default was revoked; create a key with: capyctl create key NAME\n",
            )

    def admin_token(self) -> str:
        path = self.root / ADMIN_TOKEN
        if path.exists() and (token := path.read_text().strip()):
            return token
        token = secrets.token_urlsafe(32)
        _write_secret(path, token + "\n")
        return token

    def read_admin_token(self) -> str | None:
        path = self.root / ADMIN_TOKEN
        return path.read_text().strip() if path.exists() else None

    def write_management(self, url: str) -> None:
        (self.root / MANAGEMENT).write_bytes(msgspec.json.encode({"url": url, "pid": os.getpid()}))

    def read_management(self) -> dict[str, object] | None:
        path = self.root / MANAGEMENT
        return msgspec.json.decode(path.read_bytes()) if path.exists() else None

    def clear_management(self) -> None:
        (self.root / MANAGEMENT).unlink(missing_ok=True)
