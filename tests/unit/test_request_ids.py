"""Request IDs are ULIDs: python-ulid reads them back, with the time they were made; a forked child makes
IDs of its own."""

from __future__ import annotations

import os
import time

from ulid import ULID

from capyctl.adapters.http.ids import new_request_id

make = new_request_id


def test_a_request_id_is_a_ulid_of_now() -> None:
    before = time.time()
    made = make()
    after = time.time()
    assert len(made) == 26 and made == made.upper()
    parsed = ULID.from_str(made)
    assert str(parsed) == made
    assert int(before * 1000) / 1000 <= parsed.timestamp <= after + 0.001


def test_request_ids_differ_and_their_random_part_varies_in_every_character() -> None:
    made = [make() for _ in range(20_000)]
    assert len(set(made)) == len(made)
    for position in range(10, 26):  # the 80 random bits: every character takes many values
        assert len({m[position] for m in made}) > 16


def test_every_random_bit_of_an_id_is_used() -> None:
    """The 80 random bits: over many IDs each is seen both 0 and 1, and about half the time each."""
    made = [ULID.from_str(make()) for _ in range(4_000)]
    randoms = [int.from_bytes(bytes(u)[6:], "big") for u in made]
    for bit in range(80):
        ones = sum(r >> bit & 1 for r in randoms)
        assert 1_700 < ones < 2_300, (bit, ones)


def test_a_forked_child_does_not_repeat_its_parents_ids() -> None:
    """The random part comes from a generator the child seeds afresh: the IDs a parent and its child make
    after the fork differ (with one shared state, they would be equal in all 80 random bits)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its IDs to the pipe, then out at once
        os.write(write, "".join(new_request_id() for _ in range(8)).encode())
        os._exit(0)
    os.close(write)
    parent = [new_request_id() for _ in range(8)]
    with os.fdopen(read, "rb") as pipe:
        text = pipe.read().decode()
    os.waitpid(pid, 0)
    child = [text[i : i + 26] for i in range(0, len(text), 26)]
    assert len(child) == 8
    assert not {c[10:] for c in child} & {p[10:] for p in parent}
