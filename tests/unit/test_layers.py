"""The layer rules of docs/development.md ("Layers"), checked by import-linter's contracts in pyproject.toml."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_import_contracts_hold() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert "Contracts: 7 kept, 0 broken." in done.stdout, done.stdout + done.stderr
    assert done.returncode == 0


def _private_imports(source: str) -> list[str]:
    """Imports in ``source`` of another package's private module or ``_name``."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
            names: list[str] = []
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules, names = [node.module], [alias.name for alias in node.names]
        else:
            continue
        for module in modules:
            if module.split(".")[0] == "capyctl":
                continue
            parts = module.split(".") + names  # the first part too: CPython's own _sha256 is as private
            if any(part.startswith("_") and not part.startswith("__") for part in parts):
                found.append(f"{module}: {', '.join(names) or module}")
    return found


def test_no_code_imports_a_private_module_or_name_of_another_package() -> None:
    """Other packages are used through their public API only: a private module or name can change in any
    release (CapyCTL's own private modules are its business)."""
    assert _private_imports("from a._b import c") and _private_imports("from a import _c")
    assert _private_imports("import a._b") and not _private_imports("from capyctl.x import _y")
    assert not _private_imports("from a.b import c, __version__")
    assert _private_imports("from _sha256 import sha256") and _private_imports("import _sha2")
    assert _private_imports("from _thread import allocate_lock")
    offending = {
        str(path.relative_to(ROOT)): found
        for path in sorted((ROOT / "src").rglob("*.py"))
        if (found := _private_imports(path.read_text()))
    }
    assert offending == {}


def test_the_relay_takes_the_c_way_exactly_where_it_was_built() -> None:
    """The C scan is optional (CapyCTL installs and serves without a compiler, on the Python way). Where the
    install had a compiler it must be there (a module that failed to build would only show as slower
    relaying); on any machine the SSE parser hands the scan's facts on exactly when the module is there."""
    import importlib.util
    import os
    import shutil

    from capyctl.adapters.engines import _sse

    built = importlib.util.find_spec("capyctl._speedups.scan") is not None
    compiler = os.environ.get("CC", "gcc").split()[0]
    if compiler != "false" and shutil.which(compiler) is not None:
        assert built, f"a C compiler ({compiler}) is here, yet the scan module was not built"
    assert (_sse.scan_run is not None) == built
    read = b'data: {"model":"m","choices":[{"index":0,"delta":{"content":"hi"}}]}\n\n'
    (chunks,) = _sse.SseParser().feed(read)
    assert (chunks.facts is not None) == built
    (plain,) = _sse.SseParser(scan=False).feed(read)
    assert plain.facts is None and plain.payload_list() == chunks.payload_list()
