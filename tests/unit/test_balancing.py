"""The balancing rule (``domain.balancing``): load from CapyCTL's count and the engine's fresh samples (less
CapyCTL's requests they counted that have ended since), unknown load never zero, KV pressure, wake cost, ties
taking turns; and when a request may move to another instance."""

from __future__ import annotations

import pytest

from capyctl.domain.balancing import (
    KV_PENALTY,
    MAX_TRIES,
    SAMPLE_MAX_AGE,
    Load,
    Sample,
    Unsent,
    choose,
    may_fail_over,
    scores,
)

NOW = 1000.0


def fresh(running: int, waiting: int = 0, kv: float | None = None) -> Sample:
    return Sample(running, waiting, NOW - 0.5, kv)


def test_the_engines_own_count_counts_when_it_is_larger_than_capyctls() -> None:
    loads = [Load(0, True, 2, fresh(9, 3)), Load(1, True, 5, fresh(1))]
    assert [s.score for s in scores(loads, NOW, 32)] == [12, 5]
    assert choose(loads, NOW, 32, 0).instance == 1


def test_capyctls_requests_a_sample_counted_that_have_ended_since_are_taken_off_its_count() -> None:
    # sampled while one request of CapyCTL's ran at each (20 of them had left 0 before; 7 had left 1)
    at_zero = Sample(1, 0, NOW - 0.5, None, in_flight=1, left=20)
    at_one = Sample(1, 0, NOW - 0.5, None, in_flight=1, left=7)
    ended = [Load(0, True, 0, at_zero, left=21), Load(1, True, 0, at_one, left=7)]  # 0's ended; 1's runs on
    assert [s.engine for s in scores(ended, NOW, 32)] == [0, 1]
    assert choose(ended, NOW, 32, 1).instance == 0  # the one just answered is free again
    # others' requests always count: no more is taken off than CapyCTL had there when the sample was read
    busy = Sample(9, 2, NOW - 0.5, None, in_flight=2, left=0)
    assert scores([Load(0, True, 0, busy, left=50)], NOW, 32)[0].engine == 9
    # and requests that both began and ended after the sample (in flight none then) take nothing off
    quiet = Sample(3, 0, NOW - 0.5, None, in_flight=0, left=4)
    assert scores([Load(0, True, 1, quiet, left=9)], NOW, 32)[0].engine == 3


def test_a_stale_missing_or_failed_sample_is_unknown_load_never_zero() -> None:
    stale = Sample(0, 0, NOW - SAMPLE_MAX_AGE - 0.1)
    loads = [Load(0, True, 1, fresh(6)), Load(1, True, 0, stale), Load(2, True, 2, None)]
    got = scores(loads, NOW, 32)
    assert [s.score for s in got] == [6, 6, 6]  # the unknown ones count as the busiest known one
    assert [s.engine for s in got] == [6, None, None]
    assert got[1].age_s == pytest.approx(SAMPLE_MAX_AGE + 0.1)
    # a sample from the future (a clock that went back) is no better than a stale one
    assert scores([Load(0, True, 0, Sample(0, 0, NOW + 5)), Load(1, True, 3, fresh(3))], NOW, 32)[0].score == 3


def test_with_no_sample_known_capyctls_own_count_decides() -> None:
    loads = [Load(0, True, 4, None), Load(1, True, 1, None), Load(2, True, 2, None)]
    assert choose(loads, NOW, 32, 0).instance == 1


def test_an_unknown_instance_takes_turns_with_the_busiest_known_one_and_loses_to_a_quieter_one() -> None:
    loads = [Load(0, True, 7, fresh(7)), Load(1, True, 3, None)]
    assert [choose(loads, NOW, 32, turn).instance for turn in range(2)] == [0, 1]  # not starved
    loads = [Load(0, True, 7, fresh(7)), Load(1, True, 3, None), Load(2, True, 2, fresh(2))]
    assert {choose(loads, NOW, 32, turn).instance for turn in range(3)} == {2}  # nor taken for idle


def test_kv_cache_pressure_adds_up_to_its_penalty_from_eighty_percent() -> None:
    loads = [Load(0, True, 2, fresh(2, kv=0.8)), Load(1, True, 2, fresh(2, kv=0.9)), Load(2, True, 2, fresh(2, kv=1))]
    assert [s.score for s in scores(loads, NOW, 32)] == pytest.approx([2, 2 + KV_PENALTY / 2, 2 + KV_PENALTY])
    assert choose(loads, NOW, 32, 5).instance == 0


def test_a_sleeping_instance_counts_its_wake_cost() -> None:
    loads = [Load(0, True, 31, None), Load(1, False, 0, None)]
    assert choose(loads, NOW, 32, 0).instance == 0  # the ready one, below the cost of a wake
    loads = [Load(0, True, 33, None), Load(1, False, 0, None)]
    assert choose(loads, NOW, 32, 0).instance == 1  # past it: the other one is woken


def test_equal_scores_take_turns() -> None:
    loads = [Load(0, True, 1, None), Load(1, True, 3, None), Load(2, True, 1, None), Load(3, True, 1, None)]
    assert [choose(loads, NOW, 32, turn).instance for turn in range(6)] == [0, 2, 3, 0, 2, 3]


@pytest.mark.parametrize("cause", list(Unsent))
def test_a_request_that_reached_no_engine_may_move_on(cause: Unsent) -> None:
    assert may_fail_over(cause, 1) and may_fail_over(str(cause), MAX_TRIES - 1)
    assert not may_fail_over(cause, MAX_TRIES)  # at most four instances in all


@pytest.mark.parametrize("cause", [None, "engine_error", "reset_after_write", "deadline"])
def test_a_request_an_engine_may_have_seen_never_moves(cause: str | None) -> None:
    assert not may_fail_over(cause, 1)
