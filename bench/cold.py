"""What this machine charges for code run after an idle spell: the same small steps of the relay's path,
timed back to back and after sleeping, in one process.

    python bench/cold.py [--repeat 300] [--idle-ms 0,1,5,50] [--json]

Each step is one thing every relayed request does before its engine is asked, done in C or Python as
CapyCTL does it: a call of an empty Python function, the SHA-256 of a key's 43-character secret
(``domain/keys.digest``, what a key is checked by), the decoding of a small chat body
(``adapters/http/chat.decode_body``, msgspec), and the parsing of a request's head with httptools.
For each idle time the process sleeps that long before each timed step
(``time.sleep``, the CPU left to others), then times the step alone (``time.perf_counter_ns``); printed
are the medians in µs and each one's ratio to the same step back to back (idle 0).

On a virtual machine whose CPU is shared, a step after a few milliseconds of idling can take many
times longer than back to back, whether it is Python or C: the caches, TLB and branch history it
needs were lost meanwhile. A relay's added time to first token on an idle server is made of such
steps; this prints their price here, so figures from two machines can be told apart (docs/replay.md).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httptools

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from capyctl.adapters.http.chat import decode_body  # noqa: E402 - the steps as CapyCTL takes them
from capyctl.domain.keys import digest  # noqa: E402

_SECRET = "k" * 43
_BODY = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true}'
_HEAD = (
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:8443\r\nAuthorization: Bearer capy_x\r\n"
    b"Content-Type: application/json\r\nContent-Length: 71\r\n\r\n"
)


class _Head:
    """The callbacks httptools calls, as a request parser's owner has them."""

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))


def _empty() -> None:
    return None


def _digest() -> None:
    digest(_SECRET)


def _decode_body() -> None:
    decode_body(_BODY)


def _parse_head() -> None:
    httptools.HttpRequestParser(_Head()).feed_data(_HEAD)


STEPS: dict[str, Callable[[], None]] = {
    "empty Python call": _empty,
    "SHA-256 of a key secret": _digest,
    "msgspec decode of a chat body": _decode_body,
    "httptools parse of a request head": _parse_head,
}


def timed(step: Callable[[], None], idle: float, repeat: int) -> float:
    """The median µs of ``step`` over ``repeat`` runs, each after sleeping ``idle`` seconds (0: none)."""
    times = []
    for _ in range(repeat):
        if idle:
            time.sleep(idle)
        began = time.perf_counter_ns()
        step()
        times.append(time.perf_counter_ns() - began)
    return statistics.median(times) / 1000


def idle_times(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--idle-ms takes milliseconds separated by commas, such as 0,1,5,50; got {text!r}"
        ) from None
    if not values or any(value < 0 or value > 10_000 for value in values):
        raise argparse.ArgumentTypeError(f"--idle-ms takes one or more times from 0 to 10000 ms; got {text!r}")
    return values if values[0] == 0 else [0.0, *values]  # back to back first: the baseline of the ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=300, help="timed runs per step and idle time (default 300)")
    parser.add_argument(
        "--idle-ms",
        type=idle_times,
        default=idle_times("0,1,5,50"),
        help="idle times before each run, in ms, comma-separated (0, back to back, is always "
        "measured first; default 0,1,5,50)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = parser.parse_args(argv)
    if args.repeat < 1:
        parser.error(f"--repeat must be at least 1; got {args.repeat}")
    for step in STEPS.values():  # loaded and warmed: what is measured is coldness, not a first use
        timed(step, 0, 50)
    results = {
        name: {f"{ms:g}": timed(step, ms / 1000, args.repeat) for ms in args.idle_ms} for name, step in STEPS.items()
    }
    if args.json:
        print(json.dumps({"repeat": args.repeat, "idle_ms": args.idle_ms, "median_us": results}))
        return 0
    columns = [f"{ms:g} ms" for ms in args.idle_ms]
    print(f"median µs of each step after each idle time ({args.repeat} runs each); × its time back to back")
    print(f"{'step':<36}" + "".join(f"{column:>18}" for column in columns))
    for name, row in results.items():
        base = row["0"]
        cells = [f"{value:8.1f} ({value / base:5.1f}×)" if base else f"{value:8.1f}" for value in row.values()]
        print(f"{name:<36}" + "".join(f"{cell:>18}" for cell in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
