"""Contract suite: recorded engine traffic served by the replay engine, relayed by a real CapyCTL.

Every recording folder (``recordings/<engine>/<version>/`` with a
``metadata.json``) gets its own replay engine process and an attached
deployment named ``<engine>-<version>`` in one CapyCTL process. What a client
receives is pinned by syrupy snapshots (``.sse`` for streams, ``.json`` for
assembled answers).

``--live-engine FAMILY[@VERSION]=URL`` (repeatable) runs the live checks of
``test_live.py`` against an engine you run yourself; a real ``llama-server``
is always started for them too.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
from syrupy.extensions.single_file import SingleFileSnapshotExtension, WriteMode

from tests.integration.harness import CapyServer

RECORDINGS = Path(__file__).parent / "recordings"
_LISTENING = re.compile(r"listening on (http://\S+)")


@dataclass
class Folder:
    engine: str
    version: str
    path: Path
    meta: dict[str, Any]
    url: str = ""
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def deployment(self) -> str:
        return f"{self.engine}-{self.version}"

    def cases(self, expect: str) -> list[str]:
        return sorted(name for name, case in self.meta["cases"].items() if case["expect"] == expect)


def folders() -> list[Folder]:
    found = []
    for meta_path in sorted(RECORDINGS.glob("*/*/metadata.json")):
        meta = msgspec.json.decode(meta_path.read_bytes())
        found.append(Folder(meta_path.parent.parent.name, meta_path.parent.name, meta_path.parent, meta))
    return found


def cases(expect: str, stream_only: bool = True) -> list[tuple[str, str]]:
    """(folder id, case) pairs of every recording with this expectation."""
    return [
        (f.deployment, case)
        for f in folders()
        for case in f.cases(expect)
        if not stream_only or (f.path / f"{case}.sse").exists()
    ]


class SseSnapshot(SingleFileSnapshotExtension):
    file_extension = "sse"
    _write_mode = WriteMode.TEXT


class JsonSnapshot(SingleFileSnapshotExtension):
    file_extension = "json"
    _write_mode = WriteMode.TEXT


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--live-engine",
        action="append",
        default=[],
        metavar="FAMILY[@VERSION]=URL",
        help="also run the live contract checks against this running engine (repeatable)",
    )


def _start_replay(folder: Folder) -> None:
    folder.process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "capyctl.replay",
            "--dialect",
            folder.engine,
            "--version",
            folder.version,
            "--recordings",
            str(folder.path),
            "--port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert folder.process.stdout is not None
    line = folder.process.stdout.readline().decode()
    match = _LISTENING.search(line)
    assert match, f"replay engine for {folder.path} did not start: {line}"
    folder.url = match.group(1)


@pytest.fixture(scope="session")
def replayed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[CapyServer, dict[str, Folder]]]:
    """One CapyCTL with an attached deployment per recording folder, each on its replay engine."""
    tmp = tmp_path_factory.mktemp("contract")
    every = folders()
    server = CapyServer(tmp / "state")
    try:
        for folder in every:
            _start_replay(folder)
        server.start()
        for folder in every:
            doc = {
                "name": folder.deployment,
                "engine": folder.engine,
                "endpoint": folder.url,
                "engine_version": folder.version,
            }
            path = tmp / f"{folder.deployment}.yaml"
            path.write_bytes(msgspec.yaml.encode(doc))
            server.cli("deploy", "model", "--file", str(path))
        yield server, {f.deployment: f for f in every}
    finally:
        server.stop()
        for folder in every:
            if folder.process is not None:
                folder.process.terminate()
                folder.process.wait(10)


def live_targets(config: pytest.Config) -> list[tuple[str, str | None, str]]:
    targets = []
    for value in config.getoption("--live-engine"):
        left, sep, url = value.partition("=")
        if not sep or not url.startswith("http"):
            raise pytest.UsageError(f"--live-engine {value!r}: expected FAMILY[@VERSION]=URL")
        family, _, version = left.partition("@")
        targets.append((family, version or None, url.rstrip("/")))
    return targets


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "live_target" in metafunc.fixturenames:
        given = live_targets(metafunc.config)
        ids = [f"{family}={url}" for family, _, url in given]
        metafunc.parametrize("live_target", ["spawned-llama-server", *given], ids=["spawned-llama-server", *ids])
