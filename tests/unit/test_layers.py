"""The layer rules of ARCHITECTURE.md, checked by import-linter's contracts in pyproject.toml."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_import_contracts_hold() -> None:
    done = subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command; lint_imports_command()"],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )
    assert "Contracts: 4 kept, 0 broken." in done.stdout, done.stdout + done.stderr
    assert done.returncode == 0
