"""Request IDs: ULIDs (26 characters of Crockford base32: 48 bits of milliseconds, then 80 random bits).

Made here rather than with python-ulid, which stays for reading them: its generator keeps the IDs of one
millisecond in order with some bookkeeping, which nothing here needs. IDs of one millisecond are in no
particular order. The random bits come from the ``random`` module's shared generator, which is seeded from
the OS and seeded afresh in a forked child, so that a child never repeats its parent's IDs.
"""

from __future__ import annotations

import time
from random import getrandbits

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_PAIRS = [a + b for a in _CROCKFORD for b in _CROCKFORD]  # 10 bits as two characters


def new_request_id() -> str:
    value = (time.time_ns() // 1_000_000) << 80 | getrandbits(80)
    # 128 bits as 13 pairs of 5-bit characters, most significant first (a ULID's 130 bits, 2 of them 0)
    return "".join([_PAIRS[value >> shift & 1023] for shift in range(120, -10, -10)])
