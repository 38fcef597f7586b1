"""The rules of a host's control link (``domain/hosts``), in virtual time: ``now`` is a number, nothing sleeps."""

import msgspec
import pytest

from capyctl.domain.errors import InvalidConfig
from capyctl.domain.hosts import (
    CommandLedger,
    HostState,
    LinkFacts,
    LinkTimings,
    Verdict,
    link_state,
)
from capyctl.domain.link import Command, CommandResult

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
