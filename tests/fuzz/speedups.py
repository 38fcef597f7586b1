"""Differential fuzzing of CapyCTL's two C modules against the Python they stand in for, for a bounded time.

    python -m tests.fuzz.speedups [--seconds 60]

- ``_speedups/scan.c`` (``scan_run``): runs made of the recordings' chunks and of random JSON chunks, then
  cut, mutated byte by byte, spliced; whatever the scan accepts, msgspec's decode of the heads must accept
  too, with the same facts (``check_against_decode`` of the unit tests).
- ``_speedups/chunked.c`` (``dechunk``): random chunked bodies (extensions, trailers, mutated
  framing) read at random boundaries; nothing httptools refuses may be taken, and what both take must be the
  same body.

``scripts/fuzz-c`` runs this with both modules compiled with AddressSanitizer and UndefinedBehaviorSanitizer
(any memory error or undefined behaviour aborts the run); ``.ci/run`` runs that script. Each module gets
``--seconds``; a failing input is printed with its seed before the assertion.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import msgspec
import pytest

from tests.unit import test_chunked as chunked_tests
from tests.unit.test_run_scan import body_of, check_against_decode

RECORDINGS = Path(__file__).parents[1] / "contract" / "recordings"


def _recorded_chunks() -> list[bytes]:
    chunks = []
    for path in sorted(RECORDINGS.glob("*/*/*.sse")):
        for event in path.read_bytes().replace(b"\r\n", b"\n").split(b"\n\n"):
            if event.startswith(b"data: {") and b"\n" not in event:
                chunks.append(event[6:])
    return chunks


def _random_json(rng: random.Random, depth: int = 0) -> object:
    kind = rng.randrange(8 if depth < 4 else 5)
    if kind == 0:
        return rng.choice([None, True, False])
    if kind == 1:
        return rng.choice([0, -1, 7, 2**63, 10**25, 0.5, -0.0, 1e300])
    if kind in (2, 3, 4):
        return "".join(rng.choice("ab\u00e9\u20ac\U0001f600\"\\\n ") for _ in range(rng.randrange(6)))
    if kind == 5:
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(3))]
    keys = ["model", "choices", "index", "delta", "content", "role", "tool_calls", "usage", "id", "x"]
    return {rng.choice(keys): _random_json(rng, depth + 1) for _ in range(rng.randrange(4))}


def _mutate(rng: random.Random, data: bytes) -> bytes:
    data = bytearray(data)
    for _ in range(rng.randrange(4)):
        if not data:
            break
        at = rng.randrange(len(data))
        choice = rng.randrange(4)
        if choice == 0:
            data[at] = rng.randrange(256)
        elif choice == 1:
            del data[at]
        elif choice == 2:
            data[at:at] = rng.choice([b'"', b"\\", b"{", b"}", b"[", b",", b":", b"9" * 20, b"\\u", b"\xff"])
        else:
            data[at:] = data[at:][: rng.randrange(len(data) - at + 1)]
    return bytes(data)


def fuzz_scan(seconds: float, seed: int) -> tuple[int, int]:
    rng = random.Random(seed)
    recorded = _recorded_chunks()
    deadline, count, taken = time.monotonic() + seconds, 0, 0
    while time.monotonic() < deadline:
        payloads = []
        for _ in range(rng.randrange(2, 7)):
            if rng.randrange(4):
                payloads.append(rng.choice(recorded))
            else:
                payloads.append(msgspec.json.encode(_random_json(rng)))
        body = body_of(payloads)
        if rng.randrange(3) == 0:
            body = _mutate(rng, body)
        try:
            taken += check_against_decode(body) is not None
        except AssertionError:
            print(f"scan: seed {seed}, case {count}: {body!r}")
            raise
        count += 1
    return count, taken


def fuzz_chunked(seconds: float, seed: int) -> int:
    rng = random.Random(seed)
    head = chunked_tests.HEAD
    deadline, count = time.monotonic() + seconds, 0
    with pytest.MonkeyPatch.context() as patch:
        while time.monotonic() < deadline:
            pieces = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40))) for _ in range(rng.randrange(5))]
            extension = rng.choice([b"", b";x=1", b";name", b';q="a b"', b";a=", b"; x", b";\x00"])
            trailer = rng.choice([b"", b"x-t: 1\r\n", b":\r\n", b"a: \x01\r\n"])
            body = chunked_tests.chunked(pieces, extension, trailer)
            if rng.randrange(3) == 0:
                body = _mutate(rng, body)
            cuts = [rng.randrange(len(body) + 1) for _ in range(rng.randrange(4))]
            reads = chunked_tests.split(head + body, cuts)
            ours = chunked_tests.received(reads, True, patch)
            theirs = chunked_tests.received(reads, False, patch)
            # nothing httptools refuses is taken, and what both take is the same body (dechunk may refuse more:
            # extensions RFC 9112 does not allow, which httptools lets by; what comes after an answer's end
            # only keeps its connection from reuse, either way)
            if ours.complete and (not theirs.complete or b"".join(ours.body) != b"".join(theirs.body)):
                print(f"chunked: seed {seed}, case {count}: {reads!r}")
                print(f"  dechunk: complete {ours.complete}, {ours.lost!r}, {b''.join(ours.body)!r}")
                print(f"  httptools: complete {theirs.complete}, {theirs.lost!r}, {b''.join(theirs.body)!r}")
                raise AssertionError("dechunk and httptools unframed the same bytes differently")
            count += 1
    return count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="seconds of fuzzing for each module")
    parser.add_argument("--seed", type=int, default=None, help="a seed to replay (default: a new one)")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    print(f"fuzzing the C modules against their references, {args.seconds:g} s each, seed {seed}")
    count, taken = fuzz_scan(args.seconds, seed)
    print(f"  scan.c: {count} runs ({taken} taken by the scan and checked against the decode), no disagreement")
    print(f"  chunked.c: {fuzz_chunked(args.seconds, seed)} bodies, no disagreement")


if __name__ == "__main__":
    main()
