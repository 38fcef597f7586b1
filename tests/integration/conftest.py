from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fakes.broken_engine import BrokenEngine
from tests.integration.harness import CapyServer, LlamaPaths, deployment_file, llama_paths


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Everything under tests/integration runs real processes: `-m "not integration"` skips it."""
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.integration)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> object:
    """A failed test that used a CapyCTL server shows the end of that server's log beside its failure."""
    report = yield
    if report.failed and report.when == "call":
        for name, value in getattr(item, "funcargs", {}).items():
            for server in value if isinstance(value, tuple) else (value,):  # a fixture may yield it in a tuple
                if isinstance(server, CapyServer):
                    report.sections.append((f"CapyCTL's log ({name}), its last 8 KB", server.log()[-8192:]))
    return report


@pytest.fixture(scope="session")
def llama() -> LlamaPaths:
    paths = llama_paths()
    assert paths.server.exists(), f"llama-server missing at {paths.server}"
    assert paths.model.exists(), f"SmolLM2 GGUF missing at {paths.model}"
    return paths


@pytest.fixture
def capy(tmp_path: Path) -> Iterator[CapyServer]:
    """A fresh CapyCTL with nothing registered; stopped after the test, whatever happens."""
    server = CapyServer(tmp_path / "state").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, llama: LlamaPaths) -> Iterator[CapyServer]:
    """A CapyCTL serving SmolLM2 as `smollm2` on the real llama-server, shared by a module."""
    tmp = tmp_path_factory.mktemp("served")
    server = CapyServer(tmp / "state").start()
    try:
        server.cli("engine", "add", str(llama.server), "--name", "llama-server")
        server.cli(
            "deploy", "model", "--file", str(deployment_file(tmp, "smollm2", "llama-server", llama.model)), "--wait"
        )
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def engine() -> Iterator[BrokenEngine]:
    """The broken-engine stand-in (``tests/fakes/broken_engine.py``), healthy unless a request asks otherwise."""
    engine = BrokenEngine().start()
    try:
        yield engine
    finally:
        engine.stop()
