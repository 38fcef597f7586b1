"""Hosts: the rules of a control link that can fall silent, drop and come back.

Its rules are pure (times are passed in as the ``Clock`` port's monotonic
seconds):

- ``link_state``: what the server makes of a host from its link and when it
  last heard it. A closed link makes it ``disconnected`` at once; silence
  first suspends a linked host (no new request goes there), then counts it
  lost; none of these releases what it holds, since a silent host proves
  nothing about its engines. A host that joined and never linked is
  ``joined``, not lost.
- ``CommandLedger``: the host's memory of the commands it was given. The
  server sends a command again whenever it is unsure it arrived (a dropped
  link, a restart), so a command seen before is answered with its first
  result, never applied twice; and a command older than one already applied
  to its instance is refused, so a late order cannot undo a newer one.

What a host's hello proves of the engines it runs (the evidence that
releases a lost host's memory and cut requests) is read where each engine's
effects live: ``services/server_remote_engines.py``.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Mapping

import msgspec

from capyctl.domain.deployments import Strict
from capyctl.domain.engines import EngineInstall
from capyctl.domain.errors import InvalidConfig
from capyctl.domain.link import Command, CommandResult


class HostRecord(Strict, kw_only=True, frozen=True):
    """What the server keeps of a host that joined: the certificate it holds now, and every one refused."""

    name: str
    fingerprint: str  # of the certificate the host joined with
    joined_at: float  # wall clock
    revoked: list[str] = []  # fingerprints refused for this name for ever
    revoked_at: float | None = None  # set when an operator revoked the host itself
    linked_at: float | None = None  # when its agent first linked (wall clock); None: never, since it joined
    engines: list[EngineInstall] = []  # installations registered on the host (paths on its own disk)
    draining: bool = False  # an operator drained it: nothing new is placed there until it is undrained


# --- the link's state -------------------------------------------------------------------------------------


class HostState(enum.StrEnum):
    JOINED = "joined"  # joined, but its agent has never linked (``capyctl start host`` was not run there yet)
    ONLINE = "online"
    DISCONNECTED = "disconnected"  # no link now (it closed, or the server started since): takes no request
    SUSPENDED = "suspended"  # linked but silent a while: takes no new request, keeps everything it holds
    LOST = "lost"  # silent long, or without a link long: still holds its charges until it proves what runs
    REVOKED = "revoked"  # refused for good; only a new invitation brings the machine back


class LinkTimings(msgspec.Struct, frozen=True, kw_only=True):
    """How long a host may be silent before it is suspended, and before it is counted lost (seconds)."""

    suspend_after: float = 5.0
    lost_after: float = 30.0
    replace_after: float = 300.0  # lost this long: its instances are placed elsewhere (0: never)

    def __post_init__(self) -> None:
        if not 0 < self.suspend_after < self.lost_after:
            raise InvalidConfig(
                f"hosts.suspend_after must be more than 0 s and hosts.lost_after longer than it "
                f"(they are {self.suspend_after:g} s and {self.lost_after:g} s)"
            )


class LinkFacts(msgspec.Struct, frozen=True, kw_only=True):
    """What the server knows of a host's link at one moment (times: the ``Clock`` port's monotonic seconds)."""

    revoked: bool = False
    ever_linked: bool = True  # since it joined, whichever server it linked to
    linked: bool = False  # a link is up now, and the host has not said it is leaving on it
    last_heard: float | None = None  # since this server started (None: not yet)
    since: float = 0.0  # when this server started: the silence of a host not heard yet counts from here


def link_state(facts: LinkFacts, now: float, timings: LinkTimings) -> HostState:
    """A host's state ``now``.

    A link that closed is known at once: the host is ``disconnected`` from
    that instant, never counted online on the strength of its last heartbeat.
    Silence (counted from the last word heard, or from the server's start
    when none was heard since) makes a linked host suspended, then lost, and
    a host without a link lost; no state releases what a host holds.
    """
    if facts.revoked:
        return HostState.REVOKED
    if not facts.ever_linked and not facts.linked:
        return HostState.JOINED
    silent = now - (facts.last_heard if facts.last_heard is not None else facts.since)
    if silent >= timings.lost_after:
        return HostState.LOST
    if not facts.linked:
        return HostState.DISCONNECTED
    if silent >= timings.suspend_after:
        return HostState.SUSPENDED
    return HostState.ONLINE


def replacement_due(facts: LinkFacts, now: float, timings: LinkTimings) -> bool:
    """Whether a host's instances are to be placed elsewhere now: it has been lost for ``replace_after`` (a
    revoked host's instances, at once: it will never run them again); never with ``replace_after`` 0."""
    if facts.revoked:
        return True
    if timings.replace_after <= 0 or link_state(facts, now, timings) is not HostState.LOST:
        return False
    silent = now - (facts.last_heard if facts.last_heard is not None else facts.since)
    return silent - timings.lost_after >= timings.replace_after


# --- command fencing, on the host ---------------------------------------------------------------------------


class Verdict(enum.StrEnum):
    APPLY = "apply"  # carry it out, then ``record`` its result
    REPLAY = "replay"  # done before: send ``result`` again, do nothing else
    PENDING = "pending"  # being carried out now: its result goes out once recorded
    STALE = "stale"  # superseded by a newer generation: send ``result`` (the refusal), do nothing else


class Decision(msgspec.Struct, frozen=True):
    verdict: Verdict
    result: CommandResult | None = None  # what to answer now: set for REPLAY and STALE


STALE_GENERATION = "stale_generation"
LEDGER_SIZE = 1024


class CommandLedger:
    """The host's record of the commands it applied, which makes each command safe to send again.

    ``decide`` says what to do with a command; every command it answers
    APPLY must then be ``record``-ed, failures included, or copies of it stay
    PENDING. Results are kept for the newest ``size`` IDs only, the oldest
    forgotten first. A forgotten ID is a command the ledger no longer knows:
    a copy of it arriving after that is decided afresh, so it is applied
    again if its generation is still the newest for its instance (the server
    sends copies only of commands it has no answer for, far fewer than
    ``size``), and refused as stale otherwise. The newest generation of each
    instance is never forgotten, so fencing holds whatever was evicted.
    """

    def __init__(self, size: int = LEDGER_SIZE, generations: Mapping[str, int] | None = None) -> None:
        """``generations``: each instance's newest generation known already, e.g. from the engines a
        restarted agent found running, so that the ledger fences from its first command."""
        if size < 1:
            raise ValueError("a command ledger keeps at least one result")
        self._size = size
        self._results: OrderedDict[str, CommandResult] = OrderedDict()
        self._pending: set[str] = set()
        self._newest: dict[str, int] = dict(generations or {})

    def decide(self, command: Command) -> Decision:
        if (recorded := self._results.get(command.id)) is not None:
            return Decision(Verdict.REPLAY, recorded)
        if command.id in self._pending:
            return Decision(Verdict.PENDING)
        newest = self._newest.get(command.instance)
        if newest is not None and command.generation < newest:
            return Decision(
                Verdict.STALE,
                CommandResult(
                    id=command.id,
                    generation=command.generation,
                    ok=False,
                    code=STALE_GENERATION,
                    message=f"command {command.id} ({command.action} {command.instance}) has generation "
                    f"{command.generation}, older than generation {newest} already applied to the instance",
                    detail={"newest_generation": newest},
                ),
            )
        self._newest[command.instance] = command.generation
        self._pending.add(command.id)
        return Decision(Verdict.APPLY)

    def record(self, result: CommandResult) -> None:
        """Keep ``result`` as the answer to its command's copies; the oldest kept result goes past ``size``."""
        self._pending.discard(result.id)
        self._results[result.id] = result
        self._results.move_to_end(result.id)
        while len(self._results) > self._size:
            self._results.popitem(last=False)

    def newest(self, instance: str) -> int | None:
        return self._newest.get(instance)
