"""The heaps on 2 MiB pages (Linux transparent huge pages), asked for once the server has started.

CPython keeps what every request runs through on its heaps: code objects,
types, module and class dicts, anything over 512 bytes on the C heap, the
functions, small dicts, tuples and names in its own arenas. A server that has
sat idle between requests finds the translations of those pages gone from
the CPU's TLB, and on a virtual machine each miss is a walk of two page
tables. On 2 MiB pages the same bytes need 512 times fewer translations:
measured with ``bench/ab_ttft.py`` on a 2-core VM, the first token of a paced
stream came about 65 µs sooner with the C heap on huge pages and about 60 µs
sooner again with the arenas too, at the same CPU per chunk under load and
within 0.5 MB of the same resident memory (docs/replay.md).

``madvise(MADV_HUGEPAGE)`` marks the heaps' whole 2 MiB ranges (so that what
the C heap grows into is backed that way too), and ``MADV_COLLAPSE`` (Linux 6.1 and
later) moves what is already there onto huge pages at once; on an older
kernel, khugepaged does it in the background. Nothing is asked where the
administrator turned transparent huge pages off (``never``) or outside Linux.
"""

from __future__ import annotations

import ctypes
import errno
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
_THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


class HugePages(NamedTuple):
    """What was asked for: the bytes marked, and whether they were moved onto huge pages at once."""

    marked: int
    collapsed: bool
    why_not: str | None = None  # nothing was asked: why


def heap_ranges(smaps: str) -> Iterator[tuple[int, int]]:
    """The whole 2 MiB-aligned ranges (start, length) of the heaps in ``/proc/PID/smaps`` text: the C heap
    (``[heap]``) and the anonymous private mappings beside it that are at least half resident (CPython's
    own arenas for small objects, the larger blocks malloc maps), less threads' stacks (a mapping right
    above a guard page). A mapping mostly untouched is left alone: on huge pages it would all be resident."""
    for m in _mappings(smaps):
        if m.perms != "rw-p" or m.inode != "0" or m.name not in ("[heap]", ""):
            continue
        if m.name == "" and (m.guarded or m.rss * 2 < m.end - m.start):
            continue
        start, end = -(-m.start // HUGE_PAGE) * HUGE_PAGE, m.end // HUGE_PAGE * HUGE_PAGE
        if end > start:
            yield start, end - start


class _Mapping(NamedTuple):
    start: int
    end: int
    perms: str
    inode: str
    name: str
    rss: int  # resident bytes
    guarded: bool  # right above a guard page (---p): a thread's stack


def _mappings(smaps: str) -> Iterator[_Mapping]:
    """Each mapping of ``/proc/PID/smaps`` text, with what ``heap_ranges`` needs of it."""
    current: _Mapping | None = None
    for line in smaps.splitlines():
        fields = line.split()
        if len(fields) >= 5 and "-" in fields[0] and not fields[0].endswith(":"):  # a mapping's first line
            low, high = (int(bound, 16) for bound in fields[0].split("-"))
            guarded = current is not None and current.perms == "---p" and current.end == low
            if current is not None:
                yield current
            current = _Mapping(low, high, fields[1], fields[4], fields[5] if len(fields) > 5 else "", 0, guarded)
        elif current is not None and fields[:1] == ["Rss:"]:
            current = current._replace(rss=int(fields[1]) * 1024)
    if current is not None:
        yield current


def back_heap_with_huge_pages(smaps: Path = Path("/proc/self/smaps"), enabled: Path = _THP_ENABLED) -> HugePages:
    """Ask for this process's heaps on huge pages; never raises (what could not be done is said)."""
    if not sys.platform.startswith("linux"):
        return HugePages(0, False, "not Linux")
    try:
        if "[never]" in enabled.read_text():
            return HugePages(0, False, "transparent huge pages are off (never)")
        ranges = list(heap_ranges(smaps.read_text()))
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError as exc:
        return HugePages(0, False, f"transparent huge pages unavailable: {exc}")
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    marked, collapsed, refused = 0, True, None
    for start, length in ranges:
        if madvise(start, length, _MADV_HUGEPAGE) != 0:  # (a mapping gone or changed since it was read)
            refused = errno.errorcode.get(ctypes.get_errno(), "?")
            continue
        marked += length
        if madvise(start, length, _MADV_COLLAPSE) != 0:  # an older kernel (EINVAL), or memory short (EAGAIN)
            collapsed = False
    if not marked:
        return HugePages(0, False, f"madvise refused: {refused}" if refused else "no whole 2 MiB range in the heaps")
    return HugePages(marked, collapsed)
