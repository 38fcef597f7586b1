"""The machines of the several-machines tests: a LAN of network namespaces, and the server on it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.integration.machines import CONTROL_PORT, INFERENCE_PORT, Machine, until
from tests.integration.netns import Lan, available


@pytest.fixture
def lan() -> Iterator[Lan]:
    why = available()
    if why is not None:
        pytest.fail(why)
    with Lan(["gpu-a", "gpu-b"]) as made:
        yield made


def start_server(lan: Lan, tmp_path: Path, *extra: str, config: str = "") -> Machine:
    """The server of the several-machines tests (suspended after 2 s of silence, lost after 4 s), once its
    management API answers; ``extra``: more options of ``start server``; ``config``: more lines under
    ``hosts:`` in its configuration file."""
    machine = Machine(lan.server, tmp_path / "server")
    machine.state.mkdir()
    (machine.state / "config.yaml").write_text("hosts:\n  suspend_after: 2s\n  lost_after: 4s\n" + config)
    machine.start(
        "server",
        "--listen",
        f"{lan.server.address}:{INFERENCE_PORT}",
        "--control-listen",
        f"0.0.0.0:{CONTROL_PORT}",
        *extra,
    )
    until(
        lambda: (machine.state / "management.json").exists() or machine.process.poll() is not None,  # type: ignore[union-attr]
        30,
        "the server's management API",
    )
    assert machine.process is not None and machine.process.poll() is None, machine.read_log()
    return machine


@pytest.fixture
def server(lan: Lan, tmp_path: Path) -> Iterator[Machine]:
    yield start_server(lan, tmp_path)
