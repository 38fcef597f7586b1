"""docs/several-machines.md, "Try it on one machine": its commands, run as written (their paths and ports
swapped for the test's own, on 127.0.0.1), end with the host online; and a host's join refuses the server's
state directory, saying which flag to use."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.harness import free_port
from tests.integration.test_docs import section

pytestmark = pytest.mark.integration


def documented_commands() -> list[str]:
    text = section("several-machines.md", "Try it on one machine")
    commands = [line for block in re.findall(r"```sh\n(.*?)```", text, re.S) for line in block.splitlines()]
    assert [c.split()[1:3] for c in commands] == [
        ["start", "server"],
        ["invite", "host"],
        ["join", "host"],
        ["start", "host"],
    ], commands
    return commands


def test_a_server_and_a_host_on_one_machine_as_documented(tmp_path: Path) -> None:
    swaps = {
        "/tmp/capy-server": str(tmp_path / "server"),
        "/tmp/capy-host": str(tmp_path / "host"),
        "/tmp/gpu-box.join": str(tmp_path / "gpu-box.join"),
    }
    ports = {port: str(free_port()) for port in ("8443", "7445", "8444")}
    commands = []
    for line in documented_commands():
        for old, new in swaps.items():
            line = line.replace(old, new)
        for old, new in ports.items():
            line = line.replace(f"127.0.0.1:{old}", f"127.0.0.1:{new}")
        commands.append([sys.executable, "-m", "capyctl", *shlex.split(line)[1:]])
    env = {**os.environ, "CAPYCTL_STATE_DIR": str(tmp_path / "unused")}
    running: list[subprocess.Popen[bytes]] = []
    try:
        with open(tmp_path / "server.log", "wb") as log:
            running.append(
                subprocess.Popen(
                    [*commands[0], "--management", f"127.0.0.1:{free_port()}"],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
            )
        deadline = time.monotonic() + 30
        while not (tmp_path / "server" / "management.json").exists():
            assert running[0].poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
            time.sleep(0.1)
        for command in commands[1:3]:
            done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=60)
            assert done.returncode == 0, done.stderr
        # the host may not share the server's state directory: refused, naming the flag
        shared = subprocess.run(
            [*commands[2][:-2], "--state-dir", str(tmp_path / "server")],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert shared.returncode != 0 and "error [invalid_config]" in shared.stderr
        assert "--state-dir DIR" in shared.stderr
        assert not (tmp_path / "server" / "identity" / "host.json").exists()  # nothing was written there
        with open(tmp_path / "host.log", "wb") as log:
            running.append(subprocess.Popen(commands[3], stdout=log, stderr=subprocess.STDOUT, env=env))
        listing = [sys.executable, "-m", "capyctl", "list", "hosts", "--json", "--state-dir", str(tmp_path / "server")]
        deadline = time.monotonic() + 30
        while True:
            listed = json.loads(subprocess.run(listing, capture_output=True, text=True, env=env, timeout=60).stdout)
            if listed and listed[0]["state"] == "online":
                break
            assert time.monotonic() < deadline, (listed, (tmp_path / "host.log").read_text())
            time.sleep(0.2)
        assert listed[0]["name"] == "gpu-box" and listed[0]["ingress"] == f"127.0.0.1:{ports['8444']}"
    finally:
        for process in reversed(running):
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:
                process.kill()
