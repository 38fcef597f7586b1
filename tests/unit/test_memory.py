"""Memory rules (domain, pure): charges by evidence, the switch plan, the admission window and drain, idle timers."""

from __future__ import annotations

import msgspec

from capyctl.domain.memory import (
    Device,
    Fits,
    Gate,
    Holding,
    Idle,
    NeverFits,
    NotNow,
    Residency,
    Resident,
    SwitchPlan,
    Victim,
    Window,
    gate,
    idle_step,
    next_in_line,
    plan,
)

GiB = 2**30
DEVICE = Device(name="gpu0", capacity=10 * GiB, reserve=1 * GiB)  # 9 GiB usable


def awake(name: str, gib: float, last_used: float = 0.0, **kw: object) -> Resident:
    return Resident(name=name, memory=int(gib * GiB), holding=Holding.AWAKE, last_used=last_used, **kw)  # type: ignore[arg-type]


def wanted(name: str, gib: float, **kw: object) -> Resident:
    return Resident(name=name, memory=int(gib * GiB), **kw)  # type: ignore[arg-type]


def test_charges_follow_the_evidence() -> None:
    r = Resident(name="a", memory=6 * GiB, parked_memory=1 * GiB)
    assert r.charged == 0  # no process
    assert (
        msgspec.structs.replace(r, holding=Holding.AWAKE).charged == 6 * GiB
    )  # starting, serving, parking or stopping
    assert msgspec.structs.replace(r, holding=Holding.PARKED).charged == 1 * GiB  # only once the engine confirmed it


def test_a_model_that_fits_needs_no_switch() -> None:
    assert plan(DEVICE, wanted("c", 3), [awake("a", 3), awake("b", 2)]) == Fits(1 * GiB)


def test_the_smallest_set_of_least_recently_used_victims() -> None:
    others = [awake("old", 2, last_used=1), awake("mid", 2, last_used=2), awake("big", 5, last_used=3)]
    # 9 GiB usable, 9 held: 4 more are needed. {big} alone suffices: one victim beats two older ones
    result = plan(DEVICE, wanted("c", 4), others)
    assert isinstance(result, SwitchPlan) and [v.name for v in result.victims] == ["big"]
    assert result.needed == 4 * GiB
    # 2 GiB needed: of the one-victim sets, the least recently used
    result = plan(DEVICE, wanted("c", 2), others)
    assert isinstance(result, SwitchPlan) and [v.name for v in result.victims] == ["old"]


def test_of_equal_sized_sets_the_one_whose_newest_member_is_oldest() -> None:
    others = [awake("a", 3, last_used=5), awake("b", 3, last_used=1), awake("c", 3, last_used=3)]
    result = plan(DEVICE, wanted("new", 6), others)  # two of the three must go
    assert isinstance(result, SwitchPlan) and sorted(v.name for v in result.victims) == ["b", "c"]


def test_a_model_with_waiting_requests_is_never_a_victim() -> None:
    others = [awake("busy", 5, last_used=0, waiting=3), awake("quiet", 4, last_used=9)]
    result = plan(DEVICE, wanted("c", 4), others)
    assert isinstance(result, SwitchPlan) and [v.name for v in result.victims] == ["quiet"]
    result = plan(DEVICE, wanted("c", 6), others)  # only the busy one could make room: not now
    assert isinstance(result, NotNow) and "busy" in result.reason


def test_a_model_in_a_transition_is_not_moved() -> None:
    result = plan(DEVICE, wanted("c", 4), [awake("starting", 9, movable=False)])
    assert isinstance(result, NotNow)


def test_a_victim_parks_when_its_parked_footprint_still_leaves_room_else_it_stops() -> None:
    hb = Residency.HOST_BACKED
    room_to_park = [awake("a", 6, parked_memory=1 * GiB, residency=hb), awake("b", 3, last_used=5)]
    result = plan(DEVICE, wanted("c", 5), room_to_park)  # 9 held, 5 needed: a frees 5 parked, 6 stopped
    assert isinstance(result, SwitchPlan)
    assert result.victims == (Victim("a", "park", 5 * GiB),)
    result = plan(DEVICE, wanted("c", 6), room_to_park)  # 6 needed: a parked frees only 5, so it stops
    assert isinstance(result, SwitchPlan) and result.victims == (Victim("a", "stop", 6 * GiB),)


def test_restart_only_and_unsettled_victims_stop_instead_of_parking() -> None:
    hb = Residency.HOST_BACKED
    restart = plan(DEVICE, wanted("c", 4), [awake("a", 9, parked_memory=1 * GiB)])
    assert isinstance(restart, SwitchPlan) and restart.victims[0].action == "stop"  # restart_only
    unsettled = plan(
        DEVICE, wanted("c", 4), [awake("a", 9, parked_memory=1 * GiB, residency=hb, unsettled_before_output=1)]
    )
    assert isinstance(unsettled, SwitchPlan) and unsettled.victims[0].action == "stop"  # CAN-3
    settled = plan(DEVICE, wanted("c", 4), [awake("a", 9, parked_memory=1 * GiB, residency=hb)])
    assert isinstance(settled, SwitchPlan) and settled.victims[0].action == "park"


def test_a_parked_model_can_be_stopped_to_free_its_parked_footprint() -> None:
    parked = Resident(
        name="p", memory=6 * GiB, parked_memory=2 * GiB, holding=Holding.PARKED, residency=Residency.HOST_BACKED
    )
    result = plan(DEVICE, wanted("c", 8), [parked])  # 9 usable, 2 parked: 1 short
    assert isinstance(result, SwitchPlan) and result.victims == (Victim("p", "stop", 2 * GiB),)


def test_waking_a_parked_target_needs_only_the_difference() -> None:
    target = Resident(
        name="t", memory=6 * GiB, parked_memory=2 * GiB, holding=Holding.PARKED, residency=Residency.HOST_BACKED
    )
    assert plan(DEVICE, target, [awake("a", 3)]) == Fits(0)  # 9 usable = 3 + 6


def test_a_model_that_can_never_fit_is_refused_at_once_with_the_figures() -> None:
    result = plan(DEVICE, wanted("huge", 9.5), [awake("a", 1)])
    assert isinstance(result, NeverFits)
    assert (
        "huge needs 9.50 GiB" in result.reason and "10.00 GiB" in result.reason and "1.00 GiB reserved" in result.reason
    )
    pinned = plan(DEVICE, wanted("c", 6), [awake("stuck", 4, pinned=True), awake("a", 1)])
    assert isinstance(pinned, NeverFits) and "stuck 4.00 GiB" in pinned.reason  # what is pinned is named


def test_the_oldest_waiting_request_goes_first() -> None:
    assert next_in_line({"a": 5.0, "b": 2.0, "c": 9.0}) == "b"
    assert next_in_line({}) is None


def test_the_admission_window_never_resets_and_closes_early_when_idle() -> None:
    w = Window(planned_at=100.0, admission_window=2.0, drain_timeout=30.0)
    assert gate(w, 100.5, in_flight=3)[0] is Gate.ADMIT
    assert gate(w, 101.9, in_flight=5)[0] is Gate.ADMIT  # more traffic admitted: the end stays at 102
    phase, w2 = gate(w, 102.0, in_flight=5)
    assert phase is Gate.DRAIN and w2.closed_at == 102.0
    early_phase, early = gate(w, 100.5, in_flight=0)  # idle before the end: closes at once
    assert early_phase is Gate.DRAINED and early.closed_at == 100.5


def test_a_drain_past_its_timeout_fails_the_switch() -> None:
    w = Window(planned_at=0.0, admission_window=2.0, drain_timeout=30.0)
    _, w = gate(w, 2.0, in_flight=1)
    assert gate(w, 31.9, in_flight=1)[0] is Gate.DRAIN
    assert gate(w, 32.0, in_flight=1)[0] is Gate.TIMED_OUT
    assert gate(w, 20.0, in_flight=0)[0] is Gate.DRAINED


def test_idle_models_park_then_stop() -> None:
    idle = Idle(park_after=60.0, stop_after=600.0)
    assert idle_step(idle, 59.0, 0.0, Holding.AWAKE, busy=False, can_park=True) is None
    assert idle_step(idle, 60.0, 0.0, Holding.AWAKE, busy=False, can_park=True) == "park"
    assert idle_step(idle, 60.0, 0.0, Holding.AWAKE, busy=False, can_park=False) == "stop"  # restart_only
    assert idle_step(idle, 60.0, 0.0, Holding.AWAKE, busy=True, can_park=True) is None
    assert idle_step(idle, 300.0, 0.0, Holding.PARKED, busy=False, can_park=True) is None
    assert idle_step(idle, 600.0, 0.0, Holding.PARKED, busy=False, can_park=True) == "stop"
    assert idle_step(Idle(), 10**6, 0.0, Holding.AWAKE, busy=False, can_park=True) is None  # off by default
