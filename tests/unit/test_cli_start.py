"""The CLI starts lean: importing the ``capyctl`` command, and running ``capyctl list hosts``, loads none of what
only other commands need (the server's stack, cryptography, YAML). Each check runs a fresh Python and reads its
``sys.modules``; nothing here is timed (bench/cli_start.py times it)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from capyctl.adapters.storage.state_dir import StateDir
from tests.fakes.management_api import Seen, management_api

# What the command line must not import to register its commands, nor to run `list hosts`.
NEVER = [
    "cryptography",  # the PKI: invite host, join host, the servers
    "yaml",  # configuration and deployment files
    "litestar",
    "uvicorn",
    "dependency_injector",
    "capyctl.services",
    "capyctl.adapters.pki",
    "capyctl.adapters.config_files",
    "capyctl.adapters.control",
    "capyctl.adapters.http",
    "capyctl.adapters.dashboard",
    "capyctl.domain.config",
    "capyctl.entrypoints.container",
    "capyctl.entrypoints.service",
    "httpx",  # the CLI calls the management API with the standard library's http.client
    "httpcore",
    "anyio",
]
# ... nor this to register the commands: the version comes with --version.
NOT_AT_START = [*NEVER, "importlib.metadata"]


def loaded(modules: list[str], names: list[str]) -> list[str]:
    return sorted(m for m in modules if any(m == name or m.startswith(name + ".") for name in names))


def run_python(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=60)


def test_registering_the_commands_imports_nothing_heavy() -> None:
    done = run_python("import json, sys\nimport capyctl.entrypoints.cli.app\nprint(json.dumps(sorted(sys.modules)))")
    assert done.returncode == 0, done.stderr
    assert loaded(json.loads(done.stdout), NOT_AT_START) == []


HOSTS = [
    {
        "name": "gpu-a",
        "state": "online",
        "drain": None,
        "address": "10.0.0.7",
        "silent_s": 0.4,
        "version": "0.1.0",
        "devices": [{"name": "gpu0", "capacity_bytes": 80 * 2**30, "reserve_bytes": 0, "charged_bytes": 8 * 2**30}],
        "engines": [{"name": "vllm", "family": "vllm", "version": "0.32.0", "path": "/opt/vllm"}],
        "instances": ["chat-0"],
    },
    {
        "name": "gpu-b",
        "state": "offline",
        "drain": "draining",
        "address": None,
        "silent_s": None,
        "version": None,
        "devices": [],
        "engines": [],
        "instances": [],
    },
]


@pytest.fixture
def management(tmp_path: Path) -> Iterator[Path]:
    """A state directory whose management API answers ``GET /hosts`` with HOSTS (a stand-in on loopback)."""
    state = StateDir(tmp_path / "state")
    state.prepare()
    token = state.admin_token()

    def respond(seen: Seen) -> tuple[int, bytes]:
        if seen.method == "GET" and seen.path == "/hosts" and seen.headers["authorization"] == f"Bearer {token}":
            return 200, json.dumps(HOSTS).encode()
        return 404, json.dumps({"error": {"code": "not_found", "message": seen.path}}).encode()

    with management_api(state, respond):
        yield state.root


LIST_HOSTS = """\
import json, sys
from capyctl.entrypoints.cli.app import main
state, report, flags = sys.argv[1], sys.argv[2], sys.argv[3:]
sys.argv = ["capyctl", "list", "hosts", "--state-dir", state, *flags]
try:
    main()
except SystemExit as exit:
    code = exit.code
with open(report, "w") as out:
    json.dump({"code": code, "modules": sorted(sys.modules)}, out)
"""


@pytest.mark.parametrize("flags", [[], ["--json"]], ids=["table", "json"])
def test_list_hosts_imports_only_what_it_needs(management: Path, tmp_path: Path, flags: list[str]) -> None:
    done = run_python(LIST_HOSTS, str(management), str(tmp_path / "modules.json"), *flags)
    assert done.returncode == 0, done.stderr
    ran = json.loads((tmp_path / "modules.json").read_text())
    assert (ran["code"], done.stderr) == (0, "")
    if flags:
        assert json.loads(done.stdout) == HOSTS
    else:
        assert done.stdout.splitlines() == [
            "NAME   STATE              ADDRESS   HEARD   VERSION  DEVICES                     ENGINES  INSTANCES",
            "gpu-a  online             10.0.0.7  0s ago  0.1.0    gpu0 8.00 GiB of 80.00 GiB  vllm     1",
            "gpu-b  offline, draining  -         -       -        -                           -        0",
        ]
    assert loaded(ran["modules"], NEVER) == []
