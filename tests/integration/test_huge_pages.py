"""A started CapyCTL has its heaps marked for huge pages (where the machine has them on)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from tests.integration.harness import CapyServer
from tests.unit.test_huge_pages import smaps_entries

ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_the_servers_heap_is_marked_for_huge_pages_once_it_serves(capy: CapyServer) -> None:
    assert capy.process is not None
    smaps = Path(f"/proc/{capy.process.pid}/smaps")
    if not ENABLED.exists() or "[never]" in ENABLED.read_text():  # the administrator's choice is kept
        assert not [e for e in smaps_entries(smaps.read_text()) if "hg" in e["VmFlags"].split()]
        return
    deadline = time.monotonic() + 20  # (asked for right after the line that says it serves)
    while True:
        marked = [e for e in smaps_entries(smaps.read_text()) if "hg" in e["VmFlags"].split()]
        if any(e["name"] == "[heap]" for e in marked):
            break
        assert time.monotonic() < deadline, "the server's heap was never marked for huge pages"
        time.sleep(0.05)
    assert sum(e["end"] - e["start"] for e in marked) >= 2 << 20
    assert capy.process.poll() is None  # and it still serves
