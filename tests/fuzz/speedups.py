"""Differential fuzzing of CapyCTL's C module against the Python it stands in for, for a bounded time.

    python -m tests.fuzz.speedups [--seconds 60] [--seed N]

``_speedups/scan.c``: reads made of the recordings' chunks and of random JSON chunks, then cut, mutated byte
by byte, spliced, are given to

- ``scan_run``: whatever it accepts, its Python reference (``_speedups/scan_reference.py``) must accept too,
  with the same facts (positions aside, which the C may leave out), and the reference is held to msgspec's
  typed decode of the heads (``check_reference`` and ``check_c`` of the unit tests); now and then the C is
  first told other object names and delta keys, some of them refused, which must leave no trace on the
  next read;
- the relay's check: over the C's facts and over the reference's (respelt in C, in Python, or spliced chunk
  by chunk) it must send, refuse and meter exactly what it does over the typed decode, and what the oracle
  over dicts does (``tests/oracle``, held to where it reads a read as the check does);
- ``respell``: at random offsets, the same bytes or the same ValueError as its reference
  (``scan_reference.respell``).

Each input the C is handed is a bytes object of its own, freshly allocated at exactly its size (``exact``),
never one that a larger buffer holds: run under ``PYTHONMALLOC=malloc`` (as ``scripts/fuzz-c`` runs it), each
is then a heap block of its own, and AddressSanitizer reports a read past its end (past its last byte and
the NUL that CPython keeps after it; an empty input is CPython's one static empty bytes, which the C
declines unread). ``scripts/fuzz-c`` runs this with the module compiled with AddressSanitizer and
UndefinedBehaviorSanitizer (any memory error or undefined behaviour aborts the run); ``.ci/run`` runs that
script. A failing input is printed with its seed and case before the assertion.
"""

from __future__ import annotations

import argparse
import array
import contextlib
import random
import time
from pathlib import Path
from typing import Any

import msgspec

from capyctl._speedups import scan, scan_reference
from capyctl.domain.fields import row_for
from capyctl.domain.metrics import Meter
from capyctl.domain.relay_check import DELTA_KEYS, OBJECT_NAMES, Refused
from capyctl.domain.streams import payloads_of
from tests.oracle import OracleCheck
from tests.unit.test_relay_check import NAME, ROWS, read_unlike_the_oracle, told
from tests.unit.test_run_scan import body_of, check_c, check_reference, checked

RECORDINGS = Path(__file__).parents[1] / "contract" / "recordings"
OTHER_OBJECTS = [
    (),
    ("usage",),
    ("usage", "x" * 40),
    tuple(f"o{i}" for i in range(16)),
    ("usage", 1),
    ("\u00e9",),
    tuple(f"o{i}" for i in range(17)),
    ["usage"],
]
OTHER_DELTA_KEYS = [
    (),
    ("role",),
    ("content", "tool_calls"),
    tuple(f"d{i}" for i in range(16)),
    ("role", 1),
    tuple(f"d{i}" for i in range(17)),
]


def exact(data: bytes) -> bytes:
    """``data`` in a bytes object of its own, just allocated at exactly its size (for the C to read)."""
    copy = bytes(memoryview(data))
    assert len(copy) == len(data) and (copy is not data or not data)
    return copy


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
        return rng.choice([0, -1, 7, 255, 256, 10**18 - 1, 10**18, 2**63, 2**64, 10**25, 0.5, -0.0, 1e300])
    if kind in (2, 3, 4):
        return "".join(rng.choice('ab\u00e9\u20ac\U0001f600"\\\n m') for _ in range(rng.randrange(6)))
    if kind == 5:
        return [_random_json(rng, depth + 1) for _ in range(rng.randrange(3))]
    keys = [
        "model",
        "choices",
        "index",
        "delta",
        "content",
        "role",
        "reasoning",
        "reasoning_content",
        "tool_calls",
        "error",
        *OBJECT_NAMES,
        "id",
        "x",
    ]
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
            data[at:at] = rng.choice(
                [
                    b'"',
                    b"\\",
                    b"{",
                    b"}",
                    b"[",
                    b",",
                    b":",
                    b"9" * 20,
                    b"\\u",
                    b"\xff",
                    b'"model":',
                    b'"model":"tiny-llama",',
                    b"e999",
                    b"\n\ndata: {",
                ]
            )
        else:
            data[at:] = data[at:][: rng.randrange(len(data) - at + 1)]
    return bytes(data)


def _check_respell(rng: random.Random, body: bytes, facts: Any) -> None:
    """C respell against the Python one: at the scan's positions, or near them, or anywhere."""
    if facts is not None and facts.positions is not None and rng.randrange(2):
        at, old = array.array("I", facts.positions), facts.model
        if rng.randrange(2) and at:
            i = rng.randrange(len(at))
            at[i] = (at[i] + rng.choice([-1, 1, 2**31])) % 2**32
    else:
        at = array.array("I", sorted(rng.randrange(len(body) + 4) for _ in range(rng.randrange(4))))
        # (a token is never empty: an empty one past the end is refused in C and taken in Python, see test_run_scan)
        old = (body[at[0] : at[0] + rng.randrange(1, 4)] if at and rng.randrange(2) else b"") or b'"m"'
    new = rng.choice([b'"my-model"', b"", b'"x"', old])
    answers = []
    for way in (scan.respell, scan_reference.respell):
        try:
            answers.append(way(exact(body), exact(at.tobytes()), exact(old), exact(new)))
        except ValueError:
            answers.append(ValueError)
    assert answers[0] == answers[1], ("respell", at.tolist(), old, new, answers)


def _check_relay(rng: random.Random, body: bytes, facts: Any, want: Any) -> None:
    """The check over the C's facts and the reference's, over the decode, and the oracle's answer, for one
    read."""
    row, limit, name = rng.choice(ROWS), rng.choice([2, 256]), rng.choice([NAME, "tiny-llama"])
    decoded = checked(body, None, None, row, limit, name)
    for scanned in (facts, want):
        for respelling in (scan.respell, scan_reference.respell, None):
            assert checked(exact(body), scanned, respelling, row, limit, name) == decoded, ("check", row, limit, name)
    if read_unlike_the_oracle([body]) is None:
        oracle = OracleCheck(row_for(*row).row, "here", name, limit)
        meter = Meter(lambda: 0.0)
        try:
            sent: Any = oracle.check(payloads_of(body), meter, 0.0)
        except Refused as refused:
            sent = (refused.sent, told(refused.error))
        assert (sent, oracle.failure, meter.text_chunks, meter.seen) == (
            decoded[0],
            decoded[1],
            decoded[4],
            decoded[5],
        ), ("oracle", row, limit, name)


def fuzz_scan(seconds: float, seed: int) -> tuple[int, int]:
    rng = random.Random(seed)
    recorded = _recorded_chunks()
    deadline, count, taken = time.monotonic() + seconds, 0, 0
    while time.monotonic() < deadline:
        payloads = []
        for _ in range(rng.randrange(1, 7)):
            if rng.randrange(4):
                payloads.append(rng.choice(recorded))
            else:
                payloads.append(msgspec.json.encode(_random_json(rng)))
        body = body_of(payloads)
        if rng.randrange(3) == 0:
            body = _mutate(rng, body)
        try:
            if rng.randrange(8) == 0:  # other names first, some refused: the next read must not see them
                with contextlib.suppress(TypeError):
                    scan.scan_run(exact(body), rng.choice(OTHER_OBJECTS), rng.choice(OTHER_DELTA_KEYS))
            want = check_reference(body)
            facts = check_c(exact(body), want, OBJECT_NAMES, DELTA_KEYS)
            if facts is not None:
                taken += 1
                _check_relay(rng, body, facts, want)
            _check_respell(rng, body, facts)
        except AssertionError:
            print(f"scan: seed {seed}, case {count}: {body!r}")
            raise
        count += 1
    return count, taken


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0, help="seconds of fuzzing for each C module")
    parser.add_argument("--seed", type=int, default=None, help="a seed to replay (default: a new one)")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(2**32)
    print(f"fuzzing the C module against its references, {args.seconds:g} s, seed {seed}")
    count, taken = fuzz_scan(args.seconds, seed)
    print(
        f"  scan.c: {count} reads ({taken} taken by the scan, their facts checked against its Python reference's "
        f"and the decode's, and the check over them against the decode's and the oracle's), respell against "
        f"its reference's; no disagreement"
    )


if __name__ == "__main__":
    main()
