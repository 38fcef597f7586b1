"""A fake virtualenv that CapyCTL registers as vLLM or SGLang, and that runs the stand-in engine.

``make_standin_venv(root, family, version)`` writes what CapyCTL's adapters read
(``capyctl/adapters/engines/_venv.py``): ``lib/python3.X/site-packages/<dist>-<version>.dist-info/METADATA``
with the ``Name`` and ``Version`` headers, and ``bin/python``. That ``bin/python``
is a small ``sh`` script: given ``-m vllm.…`` or ``-m sglang.…`` (how the adapters start
the engines) it execs the interpreter that created the virtualenv (``sys.executable``
then) on ``tests.fakes.standin_engine`` with the same arguments, in the same process
(so CapyCTL's PID and signals reach the stand-in), with ``PYTHONPATH`` naming this
checkout and ``STANDIN_FAMILY`` / ``STANDIN_VERSION`` set to the virtualenv's family
and version (``STANDIN_VERSION`` from the environment wins, to fake another
running version than the installed one). Anything else is passed to that
interpreter unchanged. ``-P`` keeps the child's working directory off ``sys.path``,
so a ``tests`` folder there cannot shadow this checkout's.
"""

from __future__ import annotations

import shlex
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTIONS = {"vllm": "vllm", "sglang": "sglang"}
DEFAULT_VERSIONS = {"vllm": "0.32.0", "sglang": "0.5.23"}


def standin_script(family: str, version: str, interpreter: str | None = None) -> str:
    """The text of the fake ``bin/python``."""
    python = shlex.quote(interpreter or sys.executable)
    safe_path = " -P" if sys.version_info >= (3, 11) else ""
    return f"""#!/bin/sh
# CapyCTL test stand-in for {family} {version}: runs tests/fakes/standin_engine.py in the engine's place.
if [ "$1" != "-m" ]; then
    exec {python} "$@"
fi
case "$2" in
    vllm|vllm.*|sglang|sglang.*) ;;
    *) exec {python} "$@" ;;
esac
STANDIN_FAMILY={shlex.quote(family)}
STANDIN_VERSION="${{STANDIN_VERSION:-{version.split("+", 1)[0]}}}"
PYTHONPATH={shlex.quote(str(REPO_ROOT))}"${{PYTHONPATH:+:$PYTHONPATH}}"
export STANDIN_FAMILY STANDIN_VERSION PYTHONPATH
exec {python}{safe_path} -m tests.fakes.standin_engine "$@"
"""


def make_standin_venv(root: Path, family: str = "vllm", version: str | None = None) -> Path:
    """Create (or refresh) the fake virtualenv at ``root`` and return ``root``.

    ``version`` defaults to 0.32.0 for vLLM and 0.5.23 for SGLang; it must be a plain
    version (digits, dots, an optional local part such as ``+cpu``).
    """
    if family not in DISTRIBUTIONS:
        raise ValueError(f"family must be one of {', '.join(DISTRIBUTIONS)}, not {family!r}")
    version = version or DEFAULT_VERSIONS[family]
    if not version or any(not (char.isalnum() or char in ".+-_") for char in version):
        raise ValueError(f"not a plain version: {version!r}")
    name = DISTRIBUTIONS[family]
    root = Path(root)
    site = root / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        f"Summary: CapyCTL test stand-in for {family} (tests/fakes/standin_engine.py)\n\n"
    )
    (info / "INSTALLER").write_text("capyctl-tests\n")
    (root / "pyvenv.cfg").write_text(
        f"home = {Path(sys.executable).parent}\ninclude-system-site-packages = false\n"
        f"version = {sys.version_info[0]}.{sys.version_info[1]}.{sys.version_info[2]}\n"
    )
    bin_dir = root / "bin"
    bin_dir.mkdir(exist_ok=True)
    python = bin_dir / "python"
    python.write_text(standin_script(family, version))
    python.chmod(0o755)
    return root
