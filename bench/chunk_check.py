"""Per-chunk CPU of the relay's check: over the C scan's facts, over msgspec's typed decode, and over dicts.

    python bench/chunk_check.py [--recording tests/contract/recordings/vllm/0.32.0/chat_stream_usage.sse]
                                [--rounds 7] [--repeat 200]

Each way is the engine adapter's ``SseParser`` then a check of each ``Chunks`` it gives, with the SSE
framing of the other events as ``EngineCall.frame`` does it:

- ``C facts``: ``SseParser()`` hands on the C scan's facts (``_speedups/scan.c``) and ``StreamCheck`` works
  from them (left out where the module was not built);
- ``typed decode``: ``SseParser(scan=False)``, and ``StreamCheck`` decodes the heads (the way of a build
  without a C compiler, and of every read the scan declines);
- ``dicts``: ``SseParser(scan=False)`` and the test oracle (``tests/oracle.py``), each payload decoded into a
  dict and read field by field: the relay as it was before its typed check, for scale.

So what is timed is parse + scan or decode + checks + meter + model rewrite + framing, per chunk.

Two shapes of network read: one read per event (a live stream, where each chunk is a read of its own) and the
whole recording in one read (a fast engine, many chunks per read). Printed: the median over rounds of µs per
chunk for each way and the ratio of the first to it. Before timing, the script checks that the ways send the
same bytes and leave the meter with the same figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from capyctl.adapters.engines._sse import SseParser, scan_run  # noqa: E402
from capyctl.domain.fields import row_for  # noqa: E402
from capyctl.domain.metrics import Meter  # noqa: E402
from capyctl.domain.relay_check import ChunkRules, StreamCheck  # noqa: E402
from capyctl.domain.streams import Chunks, Comment  # noqa: E402
from tests.oracle import OracleCheck  # noqa: E402

DEFAULT = ROOT / "tests/contract/recordings/vllm/0.32.0/chat_stream_usage.sse"
NAME = "my-model"


def clock() -> float:
    return 1.0


Way = Callable[[list[bytes]], tuple[list[bytes], Meter]]


def way(kind: str, family: str, version: str) -> Way:
    row = row_for(family, version).row
    where = f"{family} {version}"
    rules = ChunkRules(row, where)  # made once per engine version, as the service does

    def run(reads: list[bytes]) -> tuple[list[bytes], Meter]:
        meter = Meter(clock)
        parser = SseParser(scan=kind == "C facts")
        if kind == "dicts":
            oracle = OracleCheck(row, where, NAME)

            def check(chunks: Chunks, oracle: OracleCheck = oracle) -> bytes:
                return oracle.check(chunks.payload_list(), meter, clock())
        else:
            check = StreamCheck(rules, meter, NAME, clock).check
        out = []
        for data in reads:
            parts: list[bytes] = []
            for event in parser.feed(data):
                if type(event) is Chunks:
                    parts.append(check(event))
                elif type(event) is Comment:
                    parts += (event.raw, b"\n\n")
                else:
                    parts.append(b"data: [DONE]\n\n")
            out.append(b"".join(parts))
        return out, meter

    return run


def per_chunk_us(run: Way, reads: list[bytes], chunks: int, repeat: int) -> float:
    start = time.perf_counter()
    for _ in range(repeat):
        run(reads)
    return (time.perf_counter() - start) / (repeat * chunks) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recording", type=Path, default=DEFAULT)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    family, version = args.recording.parent.parent.name, args.recording.parent.name
    data = args.recording.read_bytes().replace(b"\r\n", b"\n")
    events = [block + b"\n\n" for block in data.split(b"\n\n") if block]
    chunks = sum(1 for e in events if e.startswith(b"data: {"))
    kinds = ["C facts", "typed decode", "dicts"] if scan_run is not None else ["typed decode", "dicts"]
    ways = {kind: way(kind, family, version) for kind in kinds}
    shown = args.recording.relative_to(ROOT) if args.recording.is_relative_to(ROOT) else args.recording
    print(
        f"{shown}: {len(events)} events, {chunks} chunks; {family} {version}"
        + ("" if scan_run is not None else " (the C scan was not built: its way is left out)")
    )
    for label, reads in (("one read per event", events), ("one read in all", [data])):
        results = {name: run(reads) for name, run in ways.items()}
        (first_out, first_meter), *others = results.values()
        for out, meter in others:  # the clock is a constant here: the meters' times agree too
            assert out == first_out, "the ways relay different bytes"
            for name in ("first_text_at", "last_at", "text_chunks", "seen"):
                assert getattr(meter, name) == getattr(first_meter, name), f"the meters differ on {name}"
        figures: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.rounds):  # alternate, so a noisy machine hurts all alike
            for name, run in ways.items():
                figures[name].append(per_chunk_us(run, reads, chunks, args.repeat))
        medians = {name: statistics.median(values) for name, values in figures.items()}
        base = medians[kinds[0]]
        print(
            f"{label:>20}: "
            + ", ".join(f"{name} {us:.2f} µs/chunk ({us / base:.2f}x)" for name, us in medians.items())
            + f" (median of {args.rounds} rounds x {args.repeat})"
        )


if __name__ == "__main__":
    main()
