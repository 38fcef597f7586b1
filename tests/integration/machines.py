"""Several machines in network namespaces, as the tests drive them: CapyCTL on each machine as separate
processes (the server with its control listener, each host's agent with the identity it got by joining),
and the helpers that drive them; ``several/conftest.py`` makes and tears them down.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.integration.netns import Lan, Node

CONTROL_PORT = 7445
INFERENCE_PORT = 8443


class Machine:
    """CapyCTL on one machine (namespace), with its own state directory."""

    def __init__(self, node: Node, state: Path) -> None:
        self.node = node
        self.state = state
        self.process: subprocess.Popen[bytes] | None = None
        self.log = state.parent / f"{node.name}.log"

    def cli(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        done = self.node.run(
            [sys.executable, "-m", "capyctl", *args],
            timeout=timeout,
            env={**os.environ, "CAPYCTL_STATE_DIR": str(self.state)},
        )
        if check and done.returncode != 0:
            raise AssertionError(
                f"capyctl {' '.join(args)} on {self.node.name} exited {done.returncode}:\n"
                f"{done.stdout}\n{done.stderr}\n--- log:\n{self.read_log()}"
            )
        return done

    def start(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        """``capyctl start ARGS`` on this machine (``env``: more environment, which its engines inherit too)."""
        with open(self.log, "ab") as log:
            self.process = self.node.popen(
                [sys.executable, "-m", "capyctl", "start", *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "CAPYCTL_STATE_DIR": str(self.state), **(env or {})},
            )
        return self.process

    def read_log(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


def until(condition: Callable[[], Any], timeout: float, what: str) -> Any:
    """Polls ``condition`` until it gives something true; fails naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s (last: {value!r})")
        time.sleep(0.1)


def hosts(server: Machine) -> dict[str, dict[str, Any]]:
    return {h["name"]: h for h in json.loads(server.cli("list", "hosts", "--json").stdout)}


def invite(server: Machine, lan: Lan, name: str, *extra: str) -> Path:
    path = server.state.parent / f"{name}.join"
    server.cli(
        "invite",
        "host",
        name,
        "--server",
        f"{lan.server_address_for.get(name, lan.server.address)}:{CONTROL_PORT}",
        "--output",
        str(path),
        *extra,
    )
    return path


def joined(
    lan: Lan, server: Machine, name: str, tmp: Path, config: str | None = None, env: dict[str, str] | None = None
) -> Machine:
    """Host ``name`` joined and started (with ``config`` as its configuration file, and ``env`` in its agent's
    environment, when given), once online."""
    host = Machine(lan.hosts[name], tmp / name)
    host.cli("join", "host", "--join-file", str(invite(server, lan, name)))
    if config is not None:
        (host.state / "config.yaml").write_text(config)
    host.start("host", env=env)
    until(lambda: hosts(server)[name]["state"] == "online", 20, f"{name} online")
    return host


def _listed(server: Machine, name: str) -> str | None:
    done = server.cli("list", "hosts", "--json", check=False)
    if done.returncode != 0:
        return None
    return {h["name"]: h["state"] for h in json.loads(done.stdout)}.get(name)
