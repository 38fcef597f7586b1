"""Per-chunk CPU of the relay: the stages over dicts and the typed pass, on one recording, in one run.

    python bench/chunk_check.py [--recording tests/contract/recordings/vllm/0.32.0/chat_stream_usage.sse]
                                [--rounds 7] [--repeat 200]

Both pipelines are the product's code: ``SseParser`` (``typed=False``: every
payload decoded into a dict, as before the typed pass; default: the typed
structs), then ``services.chat._relay`` (with the stages only, or
with ``TypedRelay`` beside them), then the SSE framing the HTTP adapter does
(``data: `` + raw + blank line, joined per batch). ``_relay`` is driven
without an event loop (its source never really waits), so what is timed is
parse + decode + checks + meter + model rewrite + framing, per chunk.

Two shapes of network read: one read per event (a live stream, where each
chunk is a batch of one) and the whole recording in one read (a fast engine,
many chunks per batch). Printed: the median over rounds of µs per chunk for
each pipeline and the ratios to the first. Before timing, the script checks that
the pipelines give the same bytes and the same meter figures.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from capyctl.adapters.engines._sse import SseParser  # noqa: E402
from capyctl.domain.fields import DeltaVerifier, row_for  # noqa: E402
from capyctl.domain.metrics import Meter  # noqa: E402
from capyctl.domain.relay_check import TypedRelay, chunk_check  # noqa: E402
from capyctl.domain.requests import RequestRecord  # noqa: E402
from capyctl.domain.streams import Chunk, ModelRewrite, StreamEvent  # noqa: E402
from capyctl.services.chat import _relay  # noqa: E402

DEFAULT = ROOT / "tests/contract/recordings/vllm/0.32.0/chat_stream_usage.sse"


def clock() -> float:
    return 1.0


async def _reads(parser: SseParser, reads: list[bytes]) -> AsyncIterator[list[StreamEvent]]:
    for data in reads:
        yield list(parser.feed(data))


def _drive(events: AsyncIterator[list[StreamEvent]]) -> list[bytes]:
    """Run an async iterator whose awaits never suspend; the SSE bytes of each batch, as the adapter frames them."""
    out = []
    while True:
        try:
            events.__anext__().send(None)
        except StopIteration as done:
            parts: list[bytes] = []
            for event in done.value:
                if isinstance(event, Chunk):
                    parts += (b"data: ", event.raw, b"\n\n")
            out.append(b"".join(parts))
        except StopAsyncIteration:
            return out


def pipeline(typed: bool, family: str, version: str) -> Callable[[list[bytes]], tuple[list[bytes], Meter]]:
    row = row_for(family, version).row
    check = chunk_check(row)

    def run(reads: list[bytes]) -> tuple[list[bytes], Meter]:
        record = RequestRecord(id="bench", deployment="my-model", stream=True)
        meter = Meter(clock)
        stages = [DeltaVerifier(row.delta, f"{family} {version}"), meter, ModelRewrite(record.deployment)]
        fast = TypedRelay(check, meter, record.deployment) if typed else None
        return _drive(_relay(_reads(SseParser(typed=typed), reads), stages, record, meter, fast, clock)), meter

    return run


def per_chunk_us(run: Callable[[list[bytes]], Any], reads: list[bytes], chunks: int, repeat: int) -> float:
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
    ways = {"stages over dicts": pipeline(False, family, version), "typed pass": pipeline(True, family, version)}
    print(f"{args.recording.relative_to(ROOT) if args.recording.is_relative_to(ROOT) else args.recording}: "
          f"{len(events)} events, {chunks} chunks; {family} {version}")
    for label, reads in (("one read per event", events), ("one read in all", [data])):
        results = {name: way(reads) for name, way in ways.items()}
        (first_out, first_meter), *others = results.values()
        for out, meter in others:  # the clock is a constant here: the meters' times agree too
            assert out == first_out, "the pipelines relay different bytes"
            for name in ("first_text_at", "last_at", "text_chunks", "seen"):
                assert getattr(meter, name) == getattr(first_meter, name), f"the meters differ on {name}"
        figures: dict[str, list[float]] = {name: [] for name in ways}
        for _ in range(args.rounds):  # alternate, so a noisy machine hurts all alike
            for name, way in ways.items():
                figures[name].append(per_chunk_us(way, reads, chunks, args.repeat))
        medians = {name: statistics.median(values) for name, values in figures.items()}
        base = medians["stages over dicts"]
        print(f"{label:>20}: " + ", ".join(f"{name} {us:.2f} µs/chunk ({base / us:.2f}x)"
                                          for name, us in medians.items())
              + f" (median of {args.rounds} rounds x {args.repeat})")


if __name__ == "__main__":
    main()
