"""The dashboard's static files, served by CapyCTL itself from this package: nothing comes from another host.

``static/`` holds our own stylesheet, scripts and icon; ``static/vendor/`` holds
third-party files exactly as their npm packages ship them, pinned in
``static/vendor/MANIFEST.json`` (package, version, licence, SHA-256 of
each file), which a unit test checks against the files. They were taken
once, with ``npm pack``, and committed: nothing is fetched at install or
test time. To update one: ``npm pack <package>@<version>``, copy the file
from its ``dist/`` over the old one (the version is in its name), and
update the manifest and the templates that name it.
"""

from __future__ import annotations

from pathlib import Path

STATIC = Path(__file__).parent / "static"
TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".txt": "text/plain; charset=utf-8",
    ".json": "application/json",
    ".ico": "image/x-icon",
}


def load_assets(root: Path = STATIC) -> dict[str, tuple[bytes, str]]:
    """Every served file by its path under ``/ui/static/``, with its media type (read once, at start)."""
    files = {}
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.suffix in TYPES:
            files[path.relative_to(root).as_posix()] = (path.read_bytes(), TYPES[path.suffix])
    return files
