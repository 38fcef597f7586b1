"""The peak memory of a command and every process it starts, summed: e.g. the first build of llama.cpp.

    python bench/peak_memory.py -- ./scripts/quickstart --listen 127.0.0.1:8443

Samples the resident memory (RSS) of the command's whole process tree every 0.1 s, from ``/proc``, and
prints the largest sum seen, with how many processes ran at that moment. Summed RSS counts a page shared
by several processes once per process, so it overstates: a figure under a bound here is under it for real.
Ctrl-C or SIGTERM (or the command's end) stops it, the command with it; the peak is printed either way.
Linux only.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PAGE = os.sysconf("SC_PAGE_SIZE")


def _children() -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2 :].split()[1])
        tree.setdefault(parent, []).append(int(entry.name))
    return tree


def _tree_rss(root: int) -> tuple[int, int]:
    """(bytes resident, processes) of ``root`` and its descendants now."""
    tree, total, count, todo = _children(), 0, 0, [root]
    while todo:
        pid = todo.pop()
        try:
            total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
            count += 1
        except (OSError, ValueError, IndexError):
            pass
        todo += tree.get(pid, [])
    return total, count


def main(argv: list[str]) -> int:
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    started = time.monotonic()
    child = subprocess.Popen(argv)
    stop: list[int] = []
    for signum in (signal.SIGINT, signal.SIGTERM):  # also when started in the background (SIGINT ignored there)
        signal.signal(signum, lambda number, _: stop.append(number))
    peak, at_peak, when = 0, 0, 0.0
    while child.poll() is None:
        if stop:
            child.send_signal(signal.SIGTERM)  # (SIGINT may be ignored by a command started in the background)
            child.wait()
            break
        rss, count = _tree_rss(child.pid)
        if rss > peak:
            peak, at_peak, when = rss, count, time.monotonic() - started
        time.sleep(0.1)
    print(
        f"peak memory: {peak / 2**30:.2f} GiB summed RSS over {at_peak} processes, {when:.0f} s in; "
        f"exit {child.returncode} after {time.monotonic() - started:.0f} s",
        file=sys.stderr,
    )
    return child.returncode or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
