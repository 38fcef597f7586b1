"""The managed controller's pure decisions (``domain/lifecycle``), as tables."""

import pytest

from capyctl.domain.deployments import TRANSITIONS, Desired, InstanceState
from capyctl.domain.lifecycle import (
    GiveWay,
    OnDesire,
    RouteStep,
    Watch,
    ending_state,
    failures_after,
    fresh_budget,
    give_way,
    gone,
    holding,
    keep_last,
    on_desire,
    route_step,
    stop_path,
    wake_matches,
    watch_step,
)
from capyctl.domain.memory import Holding, Residency

S, D = InstanceState, Desired


@pytest.mark.parametrize(
    ("desired", "state", "step"),
    [
        (D.PARK, S.READY, Watch.PARK),  # drained and wanted asleep
        (D.RUN, S.PARKED, Watch.WAKE),  # a request or an operator wants it back
        (D.RUN, S.READY, Watch.WAIT),
        (D.PARK, S.PARKED, Watch.WAIT),  # already asleep
        (D.PARK, S.STARTING, Watch.WAIT),  # only a serving engine parks
        (D.ON_DEMAND, S.PARKED, Watch.WAIT),  # a stop is the launch's cancellation, not the watcher's
        (D.RUN, S.WAKING, Watch.WAIT),
    ],
)
def test_watch_step(desired: Desired, state: InstanceState, step: Watch) -> None:
    assert watch_step(desired, state) is step


@pytest.mark.parametrize(
    ("desired", "state", "launching", "action"),
    [
        (D.RUN, S.STOPPED, False, OnDesire.START),  # shown STARTING at once: a request's next look waits for it
        (D.RUN, S.FAILED, False, OnDesire.START),
        (D.RUN, S.READY, True, OnDesire.NOTHING),
        (D.STOP, S.READY, True, OnDesire.CANCEL),
        (D.ON_DEMAND, S.STARTING, True, OnDesire.CANCEL),
        (D.STOP, S.STOPPED, False, OnDesire.NOTHING),  # no launch under way: nothing to end
        (D.PARK, S.READY, True, OnDesire.NOTHING),  # a park is the watcher's, not a cancellation
    ],
)
def test_on_desire(desired: Desired, state: InstanceState, launching: bool, action: OnDesire) -> None:
    assert on_desire(desired, state, launching) is action


def test_an_operators_start_of_a_stopped_or_failed_deployment_is_a_fresh_budget() -> None:
    assert fresh_budget(D.RUN, S.FAILED) and fresh_budget(D.RUN, S.STOPPED)
    assert not fresh_budget(D.RUN, S.STARTING)  # a start under way keeps counting its failures
    assert not fresh_budget(D.ON_DEMAND, S.FAILED)


@pytest.mark.parametrize(
    ("state", "desired", "path"),
    [
        (S.READY, D.ON_DEMAND, (S.STOPPING, S.STOPPED)),
        (S.PARKED, D.STOP, (S.STOPPING, S.STOPPED)),
        (S.STOPPING, D.STOP, (S.STOPPED,)),
        (S.STOPPED, D.STOP, ()),
        (S.FAILED, D.RUN, ()),  # still wanted: it stays FAILED, with its error, for the requests that ask
        (S.FAILED, D.STOP, (S.STOPPED,)),
    ],
)
def test_stop_path(state: InstanceState, desired: Desired, path: tuple[InstanceState, ...]) -> None:
    assert stop_path(state, desired) == path


@pytest.mark.parametrize("state", list(S))
def test_every_stop_path_is_legal(state: InstanceState) -> None:
    for desired in D:
        current = state
        for step in stop_path(state, desired):
            assert step in TRANSITIONS[current], (state, desired, step)
            current = step


@pytest.mark.parametrize(
    ("state", "cancelled", "shown"),
    [
        (S.READY, True, S.STOPPING),  # a stop
        (S.PARKED, True, S.STOPPING),
        (S.STARTING, False, None),  # a failed start is already shown as one
        (S.READY, False, S.STARTING),  # a launch that broke while serving: no request may be routed to it
        (S.WAKING, False, S.STARTING),
    ],
)
def test_ending_state(state: InstanceState, cancelled: bool, shown: InstanceState | None) -> None:
    assert ending_state(state, cancelled) is shown
    if shown is not None:
        assert shown in TRANSITIONS[state]


@pytest.mark.parametrize(
    ("failures", "ready_for", "after"),
    [
        (0, None, 1),  # never ready: a failed start
        (2, 5.0, 3),  # crashed soon after it was ready: a failed start too
        (2, 60.0, 0),  # stable for long enough: the count starts again
    ],
)
def test_failures_after(failures: int, ready_for: float | None, after: int) -> None:
    assert failures_after(failures, ready_for, stable_after=60.0) == after


def test_an_end_that_was_not_the_engines_doing_counts_no_failure() -> None:
    assert failures_after(2, None, stable_after=60.0, ended_by="agent_stopped") == 2
    assert failures_after(2, 1.0, stable_after=60.0, ended_by="not_on_host") == 2
    assert failures_after(2, 1.0, stable_after=60.0) == 3  # the same end by itself: one more


@pytest.mark.parametrize(
    ("desired", "state", "refused", "closed", "step"),
    [
        (D.STOP, S.READY, False, False, RouteStep.STOPPED),  # an operator's stop holds in every window
        (D.STOP, S.STARTING, True, False, RouteStep.STOPPED),
        (D.RUN, S.STOPPED, True, False, RouteStep.REFUSED),  # no room for the start it asked for
        (D.RUN, S.READY, False, False, RouteStep.SERVE),
        (D.ON_DEMAND, S.STOPPED, False, False, RouteStep.ASK_AGAIN),  # it gave way to a switch meanwhile
        (D.PARK, S.PARKED, False, False, RouteStep.ASK_AGAIN),
        (D.RUN, S.FAILED, False, False, RouteStep.FAILED),
        (D.RUN, S.STARTING, False, True, RouteStep.CLOSED),
        (D.RUN, S.STARTING, False, False, RouteStep.WAIT),
        (D.RUN, S.WAKING, False, False, RouteStep.WAIT),
        (D.RUN, S.STOPPING, False, False, RouteStep.WAIT),  # a start given while a stop is under way
    ],
)
def test_route_step(desired: Desired, state: InstanceState, refused: bool, closed: bool, step: RouteStep) -> None:
    assert route_step(desired, state, refused, closed) is step


def test_an_engine_is_gone_once_another_launch_or_state_took_its_place() -> None:
    assert not gone(2, 2, S.READY)
    assert gone(1, 2, S.READY)  # replaced
    assert gone(2, 2, S.STARTING) and gone(2, 2, S.PARKING)


@pytest.mark.parametrize(
    ("park", "residency", "holds", "desired", "way"),
    [
        (True, Residency.HOST_BACKED, True, D.RUN, GiveWay(True, D.PARK)),
        (True, Residency.HOST_BACKED, True, D.STOP, GiveWay(True, None)),  # an operator's stop stays
        (True, Residency.RESTART_ONLY, True, D.RUN, GiveWay(False, D.ON_DEMAND)),  # parks by stopping
        (True, Residency.HOST_BACKED, False, D.RUN, GiveWay(False, D.ON_DEMAND)),  # nothing held, nothing to park
        (False, Residency.HOST_BACKED, True, D.PARK, GiveWay(False, D.ON_DEMAND)),
        (False, Residency.HOST_BACKED, True, D.ON_DEMAND, GiveWay(False, None)),
    ],
)
def test_give_way(park: bool, residency: Residency, holds: bool, desired: Desired, way: GiveWay) -> None:
    assert give_way(park, residency, holds, desired) == way


@pytest.mark.parametrize(
    ("holds", "wake_granted", "state", "held"),
    [
        (False, False, S.READY, Holding.NONE),  # its process is gone: nothing held, whatever it shows
        (True, False, S.STOPPING, Holding.AWAKE),  # still held while the engine ends: evidence, not a timer
        (True, False, S.PARKING, Holding.AWAKE),  # until the engine confirms it sleeps
        (True, False, S.PARKED, Holding.PARKED),
        (True, True, S.PARKED, Holding.AWAKE),  # a wake was granted its room back
    ],
)
def test_holding(holds: bool, wake_granted: bool, state: InstanceState, held: Holding) -> None:
    assert holding(holds, wake_granted, state) is held


def test_a_woken_engine_must_answer_as_before() -> None:
    assert wake_matches("yes", "yes") and wake_matches(None, "anything")
    assert not wake_matches("yes", "no") and not wake_matches("yes", None)


def test_keep_last_keeps_twenty() -> None:
    assert keep_last([float(i) for i in range(20)], 99.0) == [*(float(i) for i in range(1, 20)), 99.0]
    assert keep_last([], 1.5) == [1.5]
