"""The dashboard's static files: vendored ones match their pinned manifest; pages load nothing from elsewhere
and hold no inline script or style (the Content-Security-Policy would refuse them)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from capyctl.adapters.dashboard.assets import STATIC, load_assets

VENDOR = STATIC / "vendor"
TEMPLATES = STATIC.parent / "templates"
MANIFEST = json.loads((VENDOR / "MANIFEST.json").read_text())
LICENCES = {"0BSD": r"Zero.Clause BSD|BSD Zero Clause", "MIT": r"^The MIT License"}  # the only ones allowed here


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_every_vendored_file_matches_its_pinned_checksum_and_licence() -> None:
    assert MANIFEST["files"], "the manifest lists no file"
    for entry in MANIFEST["files"]:
        assert sha256(VENDOR / entry["file"]) == entry["sha256"], entry["file"]
        assert sha256(VENDOR / entry["licence_file"]) == entry["licence_sha256"], entry["licence_file"]
        assert entry["version"] in entry["file"], "a vendored file's name carries its version"
        licence = (VENDOR / entry["licence_file"]).read_text()
        assert entry["licence"] in LICENCES, entry["file"]
        assert re.search(LICENCES[entry["licence"]], licence), entry["licence_file"]


def test_the_vendor_folder_holds_nothing_the_manifest_does_not_name() -> None:
    named = {"MANIFEST.json"} | {e["file"] for e in MANIFEST["files"]} | {e["licence_file"] for e in MANIFEST["files"]}
    assert {p.name for p in VENDOR.iterdir()} == named


def test_pages_load_only_this_servers_assets_and_hold_no_inline_script_or_style() -> None:
    served = load_assets()
    for template in TEMPLATES.glob("*.html"):
        text = template.read_text()
        for url in re.findall(r'(?:src|href)="([^"{]+)"', text):
            assert not re.match(r"(?:[a-z]+:)?//", url), f"{template.name} loads {url} from elsewhere"
            if url.startswith("/ui/static/"):
                assert url.removeprefix("/ui/static/") in served, f"{template.name}: {url} is not served"
        assert not re.search(r"<script(?![^>]*\bsrc=)", text), f"{template.name} has an inline script"
        assert not re.search(r"\son[a-z]+=", text), f"{template.name} has an inline event handler"
        assert not re.search(r"\sstyle=|<style", text), f"{template.name} has an inline style"


def test_the_base_page_loads_htmx_and_its_sse_extension_as_pinned() -> None:
    base = (TEMPLATES / "base.html").read_text()
    for entry in MANIFEST["files"]:
        if entry["package"].startswith("htmx"):
            assert f"/ui/static/vendor/{entry['file']}" in base


def test_the_charts_page_loads_uplot_as_pinned_and_no_other_page_does() -> None:
    uplot = [f"/ui/static/vendor/{e['file']}" for e in MANIFEST["files"] if e["package"] == "uplot"]
    assert len(uplot) == 2, "uPlot's script and its stylesheet"
    for template in TEMPLATES.glob("*.html"):
        text = template.read_text()
        for url in uplot:
            assert (url in text) == (template.name == "charts.html"), (template.name, url)


def test_every_file_the_dashboard_serves_is_in_the_package_data() -> None:
    """A file under templates/ or static/ that pyproject.toml's package-data does not name is missing from a
    wheel (an editable install, as the tests use, would hide it)."""
    import fnmatch
    import tomllib

    root = Path(__file__).parents[2]
    package = root / "src" / "capyctl" / "adapters" / "dashboard"
    globs = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "capyctl.adapters.dashboard"
    ]
    files = [
        p.relative_to(package).as_posix()
        for folder in ("templates", "static")
        for p in (package / folder).rglob("*")
        if p.is_file() and p.name not in ("__init__.py",) and "__pycache__" not in p.parts
    ]
    assert "static/favicon.ico" in files
    missing = [f for f in files if not any(fnmatch.fnmatchcase(f, g) for g in globs)]
    assert missing == []
