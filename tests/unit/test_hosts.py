"""The rules of a host's control link (``domain/hosts``), in virtual time: ``now`` is a number, nothing sleeps."""

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from capyctl.domain.errors import InvalidConfig
from capyctl.domain.hosts import (
    Adopt,
    AdoptionStep,
    CommandLedger,
    ExpectedInstance,
    HostState,
    LinkFacts,
    LinkTimings,
    Verdict,
    adoption,
    link_state,
    takes_requests,
)
from capyctl.domain.link import Command, CommandResult, RunningInstance

H = HostState
T = LinkTimings(suspend_after=5.0, lost_after=30.0)
HEARD = 1000.0


# --- the link's state ------------------------------------------------------------------------------------


def linked(last_heard: float | None = HEARD, **facts: object) -> LinkFacts:
    return LinkFacts(linked=True, last_heard=last_heard, **facts)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("silent", "state"),
    [
        (0.0, H.ONLINE),
        (4.999, H.ONLINE),  # just before suspend_after
        (5.0, H.SUSPENDED),  # at it
        (5.001, H.SUSPENDED),
        (29.999, H.SUSPENDED),  # just before lost_after
        (30.0, H.LOST),  # at it
        (30.001, H.LOST),
        (86_400.0, H.LOST),
        (-1.0, H.ONLINE),  # heard "after" now: a caller's race, not silence
    ],
)
def test_a_linked_hosts_state_by_silence(silent: float, state: HostState) -> None:
    assert link_state(linked(), HEARD + silent, T) is state


@pytest.mark.parametrize(
    ("silent", "state"),
    [
        (0.0, H.DISCONNECTED),  # the instant its link closed: never online on the strength of its last beat
        (4.999, H.DISCONNECTED),
        (5.0, H.DISCONNECTED),  # not suspended: there is no link to be silent on
        (29.999, H.DISCONNECTED),
        (30.0, H.LOST),
    ],
)
def test_a_host_whose_link_closed_is_disconnected_at_once_then_lost(silent: float, state: HostState) -> None:
    assert link_state(LinkFacts(linked=False, last_heard=HEARD), HEARD + silent, T) is state


@pytest.mark.parametrize(
    ("since_start", "state"),
    [
        (0.0, H.DISCONNECTED),
        (3.0, H.DISCONNECTED),
        (29.999, H.DISCONNECTED),
        (30.0, H.LOST),
    ],
)
def test_after_a_server_start_a_host_not_yet_heard_is_silent_from_the_start(
    since_start: float, state: HostState
) -> None:
    assert link_state(LinkFacts(last_heard=None, since=HEARD), HEARD + since_start, T) is state


def test_a_host_that_joined_and_never_linked_is_joined_however_long_ago() -> None:
    never = LinkFacts(ever_linked=False, last_heard=None, since=0.0)
    assert link_state(never, 86_400.0, T) is H.JOINED
    assert link_state(linked(ever_linked=False), HEARD, T) is H.ONLINE  # its first link: online


@pytest.mark.parametrize(
    "facts",
    [
        LinkFacts(),
        LinkFacts(linked=True, last_heard=HEARD),
        LinkFacts(last_heard=HEARD - 100.0),
        LinkFacts(ever_linked=False),
    ],
)
def test_revoked_wins_whatever_was_heard(facts: LinkFacts) -> None:
    assert link_state(msgspec.structs.replace(facts, revoked=True), HEARD, T) is H.REVOKED


def test_the_timings_are_the_callers() -> None:
    quick = LinkTimings(suspend_after=0.5, lost_after=2.0)
    assert link_state(linked(0.0), 0.5, quick) is H.SUSPENDED
    assert link_state(linked(0.0), 2.0, quick) is H.LOST


def test_default_timings() -> None:
    assert LinkTimings() == LinkTimings(suspend_after=5.0, lost_after=30.0)


@pytest.mark.parametrize(
    ("suspend_after", "lost_after"),
    [
        (0.0, 30.0),
        (-1.0, 30.0),
        (30.0, 30.0),
        (31.0, 30.0),
        (float("nan"), 30.0),
        (5.0, float("nan")),
    ],
)
def test_timings_that_cannot_work_are_refused_naming_both_keys(suspend_after: float, lost_after: float) -> None:
    with pytest.raises(InvalidConfig) as caught:
        LinkTimings(suspend_after=suspend_after, lost_after=lost_after)
    assert "hosts.suspend_after" in caught.value.message and "hosts.lost_after" in caught.value.message


@pytest.mark.parametrize(
    ("state", "takes"),
    [
        (H.ONLINE, True),
        (H.SUSPENDED, False),
        (H.DISCONNECTED, False),
        (H.LOST, False),
        (H.REVOKED, False),
        (H.JOINED, False),
    ],
)
def test_only_an_online_host_takes_requests(state: HostState, takes: bool) -> None:
    assert takes_requests(state) is takes


# --- command fencing --------------------------------------------------------------------------------------


def command(id: str, generation: int, instance: str = "qwen/1", action: str = "launch") -> Command:
    return Command(id=id, generation=generation, instance=instance, action=action, args={})  # type: ignore[arg-type]


def done(c: Command, **detail: object) -> CommandResult:
    return CommandResult(id=c.id, generation=c.generation, ok=True, detail=dict(detail))


def test_a_new_command_is_applied() -> None:
    ledger = CommandLedger()
    decision = ledger.decide(command("c1", 1))
    assert decision.verdict is Verdict.APPLY and decision.result is None
    assert ledger.newest("qwen/1") == 1


def test_a_command_seen_again_gets_the_identical_recorded_result_and_is_not_applied() -> None:
    ledger = CommandLedger()
    c1 = command("c1", 1)
    assert ledger.decide(c1).verdict is Verdict.APPLY
    result = done(c1, pid=4242)
    ledger.record(result)
    again = ledger.decide(c1)
    assert again.verdict is Verdict.REPLAY
    assert again.result is result  # the very answer, not a new one
    assert ledger.decide(c1).result is result  # and every time after


def test_a_copy_that_arrives_while_the_first_is_applied_waits_for_its_result() -> None:
    ledger = CommandLedger()
    c1 = command("c1", 1)
    ledger.decide(c1)
    assert ledger.decide(c1).verdict is Verdict.PENDING  # never a second APPLY
    ledger.record(done(c1))
    assert ledger.decide(c1).verdict is Verdict.REPLAY


def test_a_failed_command_replays_its_failure() -> None:
    ledger = CommandLedger()
    c1 = command("c1", 1)
    ledger.decide(c1)
    failure = CommandResult(id="c1", generation=1, ok=False, code="engine_unavailable", message="no such file")
    ledger.record(failure)
    assert ledger.decide(c1).result is failure


def test_an_older_generation_is_refused_naming_both_generations() -> None:
    ledger = CommandLedger()
    ledger.decide(command("c5", 5))
    decision = ledger.decide(command("c3", 3, action="stop"))
    assert decision.verdict is Verdict.STALE
    refusal = decision.result
    assert refusal is not None
    assert (refusal.id, refusal.generation, refusal.ok, refusal.code) == ("c3", 3, False, "stale_generation")
    assert refusal.message is not None and "3" in refusal.message and "5" in refusal.message
    assert ledger.newest("qwen/1") == 5  # a refusal changes nothing


def test_the_same_generation_with_a_new_id_is_applied() -> None:
    ledger = CommandLedger()
    ledger.decide(command("launch", 4))
    assert ledger.decide(command("probe", 4, action="probe")).verdict is Verdict.APPLY


def test_a_newer_generation_after_an_older_one_is_applied_and_then_fences_the_older() -> None:
    ledger = CommandLedger()
    old = command("c1", 1)
    assert ledger.decide(old).verdict is Verdict.APPLY
    ledger.record(done(old))
    assert ledger.decide(command("c2", 2)).verdict is Verdict.APPLY
    assert ledger.decide(command("c1b", 1)).verdict is Verdict.STALE
    assert ledger.decide(old).verdict is Verdict.REPLAY  # a copy of what was applied is still answered


def test_generations_are_fenced_per_instance() -> None:
    ledger = CommandLedger()
    ledger.decide(command("a9", 9, instance="a/1"))
    assert ledger.decide(command("b1", 1, instance="b/1")).verdict is Verdict.APPLY


def test_known_generations_fence_from_the_first_command() -> None:
    ledger = CommandLedger(generations={"qwen/1": 7})
    assert ledger.decide(command("c6", 6)).verdict is Verdict.STALE
    assert ledger.decide(command("c7", 7)).verdict is Verdict.APPLY


def test_the_ledger_keeps_the_newest_results_and_forgets_the_oldest_first() -> None:
    ledger = CommandLedger(size=3)
    commands = [command(f"c{n}", n) for n in range(1, 5)]
    for c in commands:
        ledger.decide(c)
        ledger.record(done(c))
    first, *kept = commands
    for c in kept:
        assert ledger.decide(c).verdict is Verdict.REPLAY
    # c1 is forgotten: decided afresh, and generation 1 is older than the 4 applied since, so it is fenced
    assert ledger.decide(first).verdict is Verdict.STALE


def test_a_forgotten_id_whose_generation_is_still_the_newest_is_applied_again() -> None:
    ledger = CommandLedger(size=1)
    a = command("a", 1, instance="a/1")
    ledger.decide(a)
    ledger.record(done(a))
    b = command("b", 1, instance="b/1")
    ledger.decide(b)
    ledger.record(done(b))
    assert ledger.decide(a).verdict is Verdict.APPLY  # what the docstring warns of


def test_a_ledger_keeps_at_least_one_result() -> None:
    with pytest.raises(ValueError):
        CommandLedger(size=0)


# --- adoption -------------------------------------------------------------------------------------------


def running(
    instance: str = "qwen/1",
    *,
    generation: int = 3,
    pid: int = 4242,
    started: float = 5000.25,
    launch_id: str = "L3",
    deployment: str | None = None,
) -> RunningInstance:
    return RunningInstance(
        instance=instance,
        deployment=deployment or instance.split("/")[0],
        number=1,
        generation=generation,
        pid=pid,
        pid_start_time=started,
        port=30001,
        launch_id=launch_id,
    )


def expected(
    instance: str = "qwen/1",
    *,
    generation: int = 3,
    pid: int | None = 4242,
    started: float | None = 5000.25,
    launch_id: str = "L3",
) -> ExpectedInstance:
    return ExpectedInstance(
        instance=instance,
        deployment=instance.split("/")[0],
        generation=generation,
        launch_id=launch_id,
        pid=pid,
        pid_start_time=started,
    )


def actions(steps: list[AdoptionStep]) -> list[tuple[str, Adopt]]:
    return [(step.instance, step.action) for step in steps]


def test_the_same_process_is_kept() -> None:
    steps = adoption([expected()], [running()])
    assert actions(steps) == [("qwen/1", Adopt.KEEP)]
    assert steps[0].running == running() and steps[0].expected == expected()


def test_a_process_whose_pid_the_server_never_learnt_is_kept_on_its_launch() -> None:
    assert actions(adoption([expected(pid=None, started=None)], [running()])) == [("qwen/1", Adopt.KEEP)]


def test_a_reused_pid_is_stopped_and_the_launched_process_counted_gone() -> None:
    steps = adoption([expected(started=5000.25)], [running(started=7777.5)])
    assert actions(steps) == [("qwen/1", Adopt.STOP), ("qwen/1", Adopt.GONE)]
    assert "7777.5" in steps[0].reason and "5000.25" in steps[0].reason
    assert steps[0].running is not None and steps[1].expected is not None


def test_another_pid_is_stopped() -> None:
    steps = adoption([expected(pid=1)], [running(pid=2)])
    assert actions(steps) == [("qwen/1", Adopt.STOP), ("qwen/1", Adopt.GONE)]


def test_an_instance_the_server_does_not_expect_is_stopped() -> None:
    steps = adoption([], [running("stray/1")])
    assert actions(steps) == [("stray/1", Adopt.STOP)]
    assert "not expected" in steps[0].reason


def test_an_instance_the_host_does_not_report_is_gone() -> None:
    steps = adoption([expected()], [])
    assert actions(steps) == [("qwen/1", Adopt.GONE)]
    assert steps[0].running is None and steps[0].expected == expected()


def test_an_older_generation_is_stopped() -> None:
    steps = adoption([expected(generation=4, launch_id="L4")], [running(generation=3, launch_id="L3")])
    assert actions(steps) == [("qwen/1", Adopt.STOP), ("qwen/1", Adopt.GONE)]
    assert "older" in steps[0].reason and "3" in steps[0].reason and "4" in steps[0].reason


def test_a_generation_the_server_did_not_give_is_stopped() -> None:
    assert actions(adoption([expected(generation=3)], [running(generation=9)]))[0] == ("qwen/1", Adopt.STOP)


def test_another_launch_of_the_same_generation_is_stopped() -> None:
    steps = adoption([expected(launch_id="L3")], [running(launch_id="L3-bis")])
    assert actions(steps) == [("qwen/1", Adopt.STOP), ("qwen/1", Adopt.GONE)]
    assert "L3-bis" in steps[0].reason


def test_another_deployment_under_the_instance_name_is_stopped() -> None:
    steps = adoption([expected()], [running(deployment="other")])
    assert actions(steps)[0] == ("qwen/1", Adopt.STOP)


def test_a_second_process_for_a_kept_instance_is_stopped() -> None:
    steps = adoption([expected(pid=None, started=None)], [running(pid=9), running(pid=8)])
    assert actions(steps) == [("qwen/1", Adopt.KEEP), ("qwen/1", Adopt.STOP)]
    assert steps[0].running is not None and steps[0].running.pid == 8  # the choice does not follow input order


def test_steps_are_sorted_by_instance() -> None:
    steps = adoption(
        [expected("c/1"), expected("a/1"), expected("b/1", generation=2)],
        [running("b/1"), running("d/1"), running("a/1")],
    )
    assert actions(steps) == [
        ("a/1", Adopt.KEEP),
        ("b/1", Adopt.STOP),
        ("b/1", Adopt.GONE),
        ("c/1", Adopt.GONE),
        ("d/1", Adopt.STOP),
    ]


def test_an_instance_expected_twice_is_a_callers_error() -> None:
    with pytest.raises(ValueError, match="expected twice"):
        adoption([expected(), expected()], [])


# One host's worth of instances: a few names, and fields drawn from small sets so that matches happen often.
NAMES = st.sampled_from(["a/1", "a/2", "b/1", "c/1", "d/1"])
EXPECTED = st.builds(
    lambda name, g, pid, started, launch: expected(name, generation=g, pid=pid, started=started, launch_id=launch),
    NAMES,
    st.integers(1, 3),
    st.none() | st.integers(1, 3),
    st.none() | st.sampled_from([1.0, 2.0]),
    st.sampled_from(["L1", "L2"]),
)
RUNNING = st.builds(
    lambda name, g, pid, started, launch: running(name, generation=g, pid=pid, started=started, launch_id=launch),
    NAMES,
    st.integers(1, 3),
    st.integers(1, 3),
    st.sampled_from([1.0, 2.0]),
    st.sampled_from(["L1", "L2"]),
)


@given(st.lists(EXPECTED, unique_by=lambda e: e.instance), st.lists(RUNNING, unique_by=lambda r: r.instance))
def test_adoption_accounts_for_every_instance_once(
    wanted: list[ExpectedInstance], found: list[RunningInstance]
) -> None:
    steps = adoption(wanted, found)
    # every reported process is kept or stopped, once; every expected one is kept or counted gone, once
    assert sorted((s.running.instance for s in steps if s.running), key=str) == sorted(r.instance for r in found)
    assert sorted((s.expected.instance for s in steps if s.expected), key=str) == sorted(e.instance for e in wanted)
    for step in steps:
        assert (step.running is not None) == (step.action in (Adopt.KEEP, Adopt.STOP))
        assert (step.expected is not None) == (step.action in (Adopt.KEEP, Adopt.GONE))
    kept = {s.instance for s in steps if s.action is Adopt.KEEP}
    assert kept.isdisjoint(s.instance for s in steps if s.action in (Adopt.STOP, Adopt.GONE))
    for step in steps:  # a kept process is the expected launch, its pid proved where the server knew it
        if step.action is Adopt.KEEP:
            assert step.running is not None and step.expected is not None
            assert (step.running.generation, step.running.launch_id) == (
                step.expected.generation,
                step.expected.launch_id,
            )
            assert step.expected.pid in (None, step.running.pid)
            assert step.expected.pid_start_time in (None, step.running.pid_start_time)
    assert [s.instance for s in steps] == sorted(s.instance for s in steps)
    assert adoption(list(reversed(wanted)), list(reversed(found))) == steps


def test_a_deployment_with_no_host_named_goes_to_an_online_host_with_its_engine_the_same_each_time() -> None:
    from capyctl.domain.hosts import place

    online, suspended, lost = HostState.ONLINE, HostState.SUSPENDED, HostState.LOST
    assert place([]) is None
    assert place([("gpu-b", online, True), ("gpu-a", online, True)]) == "gpu-a"  # by name, every time
    assert place([("gpu-a", online, False), ("gpu-b", online, True)]) == "gpu-b"  # where it fits now
    assert place([("gpu-a", online, False), ("gpu-b", online, False)]) == "gpu-a"  # nowhere: by name (switching)
    assert place([("gpu-a", suspended, True), ("gpu-c", online, False)]) == "gpu-c"  # online before room
    assert place([("gpu-a", lost, True), ("gpu-b", suspended, True)]) == "gpu-a"  # none online: it waits
    assert place([("gpu-a", HostState.REVOKED, True)]) is None  # never a revoked host
