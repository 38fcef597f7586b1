"""Request IDs are ULIDs: python-ulid reads them back, with the time they were made; the C module and the
Python way make them alike."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest
from ulid import ULID

from capyctl.adapters.http import _ids, ids
from capyctl.adapters.http.ids import new_request_id, py_request_id

MAKERS = pytest.mark.parametrize("make", [_ids.new_request_id, py_request_id], ids=["c", "python"])


def test_the_server_makes_its_ids_with_the_c_module_where_it_was_built() -> None:
    assert ids.new_request_id is _ids.new_request_id is new_request_id


@MAKERS
def test_a_request_id_is_a_ulid_of_now(make: Callable[[], str]) -> None:
    before = time.time()
    made = make()
    after = time.time()
    assert len(made) == 26 and made == made.upper()
    parsed = ULID.from_str(made)
    assert str(parsed) == made
    assert int(before * 1000) / 1000 <= parsed.timestamp <= after + 0.001


@MAKERS
def test_request_ids_differ_and_their_random_part_varies_in_every_character(make: Callable[[], str]) -> None:
    made = [make() for _ in range(20_000)]
    assert len(set(made)) == len(made)
    for position in range(10, 26):  # the 80 random bits: every character takes many values
        assert len({m[position] for m in made}) > 16


@MAKERS
def test_every_random_bit_of_an_id_is_used(make: Callable[[], str]) -> None:
    """The 80 random bits: over many IDs each is seen both 0 and 1, and about half the time each."""
    made = [ULID.from_str(make()) for _ in range(4_000)]
    randoms = [int.from_bytes(bytes(u)[6:], "big") for u in made]
    for bit in range(80):
        ones = sum(r >> bit & 1 for r in randoms)
        assert 1_700 < ones < 2_300, (bit, ones)
