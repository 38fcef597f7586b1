"""docs/development.md names every module of ``src/capyctl/`` in its file map, and names no path that is gone.

The convention (said at the top of the map): an entry is a list item that begins with a path relative to
``src/capyctl/`` in backticks, ``- `domain/fields.py`: ...``. Every ``.py`` and C source file is a module.
A sub-package's ``__init__.py`` is covered by the entry of its folder, written with a trailing slash
(``- `adapters/http/`: ...``); the files at the top (``__init__.py``, ``__main__.py``) have entries of their
own. The tree is read when the test runs, so a module added or moved since the map was written is named.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).parents[2]
SRC = ROOT / "src" / "capyctl"
DOC = ROOT / "docs" / "development.md"
SOURCES = {".py", ".c", ".h"}  # what counts as a module: Python and C sources, not what a build leaves
ENTRY = re.compile(r"^[ \t]*[-*] `([^`]+)`", re.M)  # a list item that begins with a backticked path
PATH_LIKE = re.compile(r"^(?:\./)?[\w.-]+(?:/[\w.-]+)*/?$")
FILE_SUFFIX = re.compile(r"\.(?:py|c|h|md|json|toml|sh|txt)$")


def section(text: str, heading: str) -> str:
    """The text under ``## heading``, up to the next ``## `` heading (its ``###`` parts included)."""
    parts = text.split(f"\n## {heading}\n")
    assert len(parts) == 2, f"docs/development.md has no single '## {heading}' section"
    return parts[1].split("\n## ")[0]


def modules(src: Path) -> set[str]:
    """The modules under ``src`` as the map names them: a sub-package's ``__init__.py`` as its folder."""
    found = set()
    for path in src.rglob("*"):
        if not path.is_file() or path.suffix not in SOURCES or "__pycache__" in path.parts:
            continue
        name = path.relative_to(src).as_posix()
        if path.name == "__init__.py" and path.parent != src:
            name = path.parent.relative_to(src).as_posix() + "/"
        found.add(name)
    return found


def entries(file_map: str) -> list[str]:
    return ENTRY.findall(file_map)


def unmapped(src: Path, file_map: str) -> list[str]:
    """Modules under ``src`` without an entry in the map."""
    return sorted(modules(src) - set(entries(file_map)))


def gone(src: Path, file_map: str) -> list[str]:
    """Entries of the map whose path is not there: a folder entry must be a folder, any other a file."""
    return sorted(
        name
        for name in entries(file_map)
        if not ((src / name).is_dir() if name.endswith("/") else (src / name).is_file())
    )


def named_paths(text: str) -> set[str]:
    """The paths that backticked spans of ``text`` name (``domain/streams.py``, ``bench/request_path.py``
    in ``python bench/request_path.py --functions``): words with a slash or a file's suffix; an HTTP
    route (``/metrics``) and a dotted name (``service.cut``) are not paths."""
    words = (word for span in re.findall(r"`([^`\n]+)`", text) for word in span.split())
    return {w for w in words if PATH_LIKE.match(w) and ("/" in w or FILE_SUFFIX.search(w))}


def resolve(name: str) -> Path:
    """A path as the page writes it: from the repository's root when its first part is there (``tests/``,
    ``bench/``, ``src/`` ...), else from ``src/capyctl/`` (``adapters/http/server.py``)."""
    name = name.removeprefix("./")
    return ROOT / name if (ROOT / name.split("/")[0]).exists() else SRC / name


def test_every_module_has_an_entry_in_the_file_map() -> None:
    missing = unmapped(SRC, section(DOC.read_text(), "File map"))
    assert not missing, (
        "modules under src/capyctl/ that docs/development.md's File map does not name (add a line "
        f"'- `PATH`: what it holds' to the map): {missing}"
    )


def test_every_entry_of_the_file_map_exists() -> None:
    file_map = section(DOC.read_text(), "File map")
    assert len(entries(file_map)) >= 100, "the file map's entries were not found: is the convention kept?"
    missing = gone(SRC, file_map)
    assert not missing, f"docs/development.md's File map names paths under src/capyctl/ that are not there: {missing}"
    twice = sorted(name for name, n in Counter(entries(file_map)).items() if n > 1)
    assert not twice, f"the File map names these more than once: {twice}"


def test_every_path_the_streamed_request_names_exists() -> None:
    text = section(DOC.read_text(), "The path of a streamed request")
    named = named_paths(text)
    assert {"adapters/http/server.py", "domain/relay_check.py"} <= named, named
    missing = sorted(name for name in named if not resolve(name).exists())
    assert not missing, (
        f"docs/development.md's 'The path of a streamed request' names paths that are not there: {missing}"
    )


def test_the_checks_name_what_is_missing_and_what_is_gone(tmp_path: Path) -> None:
    """The checks above, on a small tree of their own: a module without an entry, and an entry without a
    module, are each named."""
    for name in ("__init__.py", "top.py", "pkg/__init__.py", "pkg/mapped.py", "pkg/new.py", "pkg/fast.c"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    (tmp_path / "pkg" / "__pycache__").mkdir()
    (tmp_path / "pkg" / "__pycache__" / "mapped.cpython-311.pyc").write_text("")
    (tmp_path / "pkg" / "fast.cpython-311-x86_64-linux-gnu.so").write_text("")
    file_map = (
        "- `__init__.py`: x\n- `top.py`: x\n- `pkg/`: x\n  - `pkg/mapped.py`: the\n    rest\n  - `pkg/old.py`: x\n"
    )
    assert unmapped(tmp_path, file_map) == ["pkg/fast.c", "pkg/new.py"]
    assert gone(tmp_path, file_map) == ["pkg/old.py"]
    assert named_paths("`x/y.py`, `python bench/a.py --flag`, `/metrics`, `service.cut`, `b.py`") == {
        "x/y.py",
        "bench/a.py",
        "b.py",
    }
