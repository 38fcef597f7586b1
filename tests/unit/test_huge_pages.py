"""The C heap on huge pages: which ranges are asked for, and that asking really marks this process's heap."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from capyctl.adapters.process.huge_pages import HUGE_PAGE, back_heap_with_huge_pages, heap_ranges

def mapping(bounds: str, perms: str, inode: str, name: str = "", rss_kb: int = 0) -> str:
    """One mapping as /proc/PID/smaps shows it (its first line and the fields read here)."""
    return f"{bounds} {perms} 00000000 00:00 {inode} {name}\nSize: 0 kB\nRss: {rss_kb} kB\nVmFlags: rd wr\n"


SMAPS = "".join([
    mapping("55d000000000-55d000001000", "r--p", "123", "/usr/bin/python3.11", 4),
    mapping("55d000400000-55d001a00000", "rw-p", "0", "[heap]", 1024),  # the C heap: however resident
    mapping("7f0000000000-7f0000600000", "rw-p", "0", "", 6144),  # CPython's arenas: all resident
    mapping("7f0000600000-7f0000800000", "rw-p", "789", "/usr/lib/some-data", 2048),  # a file's data
    mapping("7f0000a00000-7f0000a01000", "---p", "0"),  # a thread's guard page ...
    mapping("7f0000a01000-7f0001201000", "rw-p", "0", "", 8192),  # ... and its stack right above it
    mapping("7f0002000000-7f0006000000", "rw-p", "0", "", 4096),  # 64 MiB mapped, 4 MiB of it touched
    mapping("7f1000000000-7f1000021000", "r-xp", "456", "/usr/lib/libc.so.6", 132),
    mapping("7ffc00000000-7ffc00800000", "rw-p", "0", "[stack]", 132),
])


def test_the_heaps_whole_2_mib_ranges_are_asked_for_and_nothing_else() -> None:
    # the C heap and a resident anonymous mapping (CPython's arenas); not a file's data, a thread's stack,
    # a mostly untouched mapping (huge pages would make all of it resident), the main stack or code
    assert list(heap_ranges(SMAPS)) == [(0x55D000400000, 0x55D001A00000 - 0x55D000400000),
                                        (0x7F0000000000, 0x600000)]
    unaligned = mapping("55d000001000-55d000400fff", "rw-p", "0", "[heap]", 4)
    assert list(heap_ranges(unaligned)) == [(0x55D000200000, HUGE_PAGE)]
    too_small = mapping("55d000001000-55d000200fff", "rw-p", "0", "[heap]", 4)
    assert list(heap_ranges(too_small)) == []


def test_nothing_is_asked_for_where_transparent_huge_pages_are_off(tmp_path: Path) -> None:
    (tmp_path / "enabled").write_text("always madvise [never]\n")
    (tmp_path / "smaps").write_text(SMAPS)
    pages = back_heap_with_huge_pages(tmp_path / "smaps", tmp_path / "enabled")
    assert pages.marked == 0 and not pages.collapsed
    assert pages.why_not == ("not Linux" if not sys.platform.startswith("linux")
                             else "transparent huge pages are off (never)")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="transparent huge pages are Linux's")
def test_this_processs_heap_is_marked_and_what_collapsed_is_on_huge_pages() -> None:
    enabled = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    pages = back_heap_with_huge_pages()
    mappings = smaps_entries(Path("/proc/self/smaps").read_text())
    marked = [entry for entry in mappings if "hg" in entry["VmFlags"].split()]  # the kernel's MADV_HUGEPAGE flag
    if not enabled.exists() or "[never]" in enabled.read_text():
        assert pages.marked == 0 and not marked
        return
    assert pages.marked >= HUGE_PAGE, pages  # pytest's heap is far past 2 MiB
    assert sum(entry["end"] - entry["start"] for entry in marked) >= pages.marked
    assert any(entry["name"] == "[heap]" for entry in marked)
    assert all(entry["name"] in ("[heap]", "") and entry["perms"] == "rw-p" for entry in marked)
    if pages.collapsed:
        assert sum(int(entry["AnonHugePages"].split()[0]) for entry in marked) * 1024 >= HUGE_PAGE


def smaps_entries(smaps: str) -> list[dict]:  # type: ignore[type-arg]
    """The mappings in /proc/PID/smaps: bounds, permissions, name and fields."""
    entries: list[dict] = []  # type: ignore[type-arg]
    for line in smaps.splitlines():
        head = line.split()
        if head and "-" in head[0] and ":" not in head[0]:  # a mapping's first line
            low, high = (int(bound, 16) for bound in head[0].split("-"))
            entries.append({"start": low, "end": high, "perms": head[1], "name": head[5] if len(head) > 5 else ""})
        elif entries and ":" in line:
            name, _, value = line.partition(":")
            entries[-1][name] = value.strip()
    return entries
