"""Request IDs: ULIDs (26 characters of Crockford base32: 48 bits of milliseconds, then 80 random bits).

Made here rather than with python-ulid, which stays for reading them: its generator keeps IDs of one
millisecond in order with some bookkeeping and costs about 8 µs an ID; this costs about 1 µs, on a path
every request takes. IDs of one millisecond are in no particular order. Where the C module ``_ids`` was
built (an optional part of the install), it makes the same IDs in one call, with no Python object but the
answer: on the way to every request's engine write, where each of the fifty-odd objects the Python way
makes costs after an idle spell.
"""

from __future__ import annotations

import random
import time

_random = random.Random()  # seeded from the OS: IDs must differ, not be secret (they are no credential)
_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"
_PAIRS = [a + b for a in _CROCKFORD for b in _CROCKFORD]  # 10 bits as two characters


def py_request_id() -> str:
    value = (time.time_ns() // 1_000_000) << 80 | _random.getrandbits(80)
    # 128 bits as 13 pairs of 5-bit characters, most significant first (a ULID's 130 bits, 2 of them 0)
    pairs = _PAIRS
    return (pairs[value >> 120] + pairs[value >> 110 & 1023] + pairs[value >> 100 & 1023]
            + pairs[value >> 90 & 1023] + pairs[value >> 80 & 1023] + pairs[value >> 70 & 1023]
            + pairs[value >> 60 & 1023] + pairs[value >> 50 & 1023] + pairs[value >> 40 & 1023]
            + pairs[value >> 30 & 1023] + pairs[value >> 20 & 1023] + pairs[value >> 10 & 1023]
            + pairs[value & 1023])


try:
    from capyctl.adapters.http._ids import new_request_id
except ImportError:  # pragma: no cover - a build without a C compiler
    new_request_id = py_request_id
