"""Request IDs are ULIDs: python-ulid reads them back, with the time they were made."""

from __future__ import annotations

import time

from ulid import ULID

from capyctl.adapters.http.ids import new_request_id


def test_a_request_id_is_a_ulid_of_now() -> None:
    before = time.time()
    made = new_request_id()
    after = time.time()
    assert len(made) == 26 and made == made.upper()
    parsed = ULID.from_str(made)
    assert str(parsed) == made
    assert int(before * 1000) / 1000 <= parsed.timestamp <= after + 0.001


def test_request_ids_differ_and_their_random_part_varies_in_every_character() -> None:
    made = [new_request_id() for _ in range(20_000)]
    assert len(set(made)) == len(made)
    for position in range(10, 26):  # the 80 random bits: every character takes many values
        assert len({m[position] for m in made}) > 16
