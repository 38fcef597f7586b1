"""Which instance of a deployment serves a request, and where it goes when that instance could not take it:
the one place between the fleet and the request services where the choice is made.

``pick`` balances (``domain.balancing.choose``) over the deployment's instances
not tried yet for the request: those in reach that take new requests, else
those in reach (a draining one still serves), else any; with one instance it
is that one, at once. The fleet checks the deployment
first (its name, its API, an operator's stop, whether anything is placed).
``fail_over`` is asked when a request reached no engine: it says whether the
request may go on (``domain.balancing.may_fail_over``), and counts it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from typing import NamedTuple, Protocol

from capyctl.domain.balancing import Load, Score, choose, may_fail_over
from capyctl.domain.ports import Clock
from capyctl.services.controllers import Serving


class Instances(Protocol):
    def instances(self, model: str, api: str) -> Sequence[Serving]:
        """The instances of deployment ``model`` that may serve a request of ``api``, by index; raises for a
        deployment that cannot (unknown, another API, stopped by an operator, nothing placed)."""


class Picked(NamedTuple):
    instance: Serving
    scores: list[Score] | None  # each candidate's score, when there was a choice to make
    size: int  # the deployment's instances


class Router:
    def __init__(self, fleet: Instances, clock: Clock, wake_cost: int) -> None:
        self._fleet = fleet
        self._clock = clock
        self._wake_cost = wake_cost  # what a sleeping instance's wake counts, in requests
        self._turns: dict[str, int] = {}  # choices made per deployment: equal scores take turns
        self.selections: Counter[tuple[str, int]] = Counter()  # (deployment, instance) -> requests sent there
        self.failovers: Counter[tuple[str, str]] = Counter()  # (deployment, reason) -> requests moved on

    def pick(self, model: str, api: str, tried: Collection[int] = ()) -> Picked:
        """The instance a request of ``api`` for ``model`` goes to, not one of ``tried`` (see ``Picked``)."""
        instances = self._fleet.instances(model, api)
        count = len(instances)
        if count == 1 and not tried:  # the usual case: no choice
            return Picked(instances[0], None, 1)
        left = [i for i in instances if i.index not in tried]
        if not left:
            raise LookupError(f"every instance of {model} was tried")  # (``fail_over`` stops before this)
        reachable = [i for i in left if i.held() is None]
        reachable = [i for i in reachable if not i.draining] or reachable or left  # the best group there is
        if len(reachable) == 1:
            return Picked(reachable[0], None, count)
        turn = self._turns.get(model, 0)
        self._turns[model] = turn + 1
        loads = [Load(i.index, i.route_now() is not None, i.in_flight, i.sample, i.left) for i in reachable]
        choice = choose(loads, self._clock.monotonic(), self._wake_cost, turn)
        return Picked(next(i for i in reachable if i.index == choice.instance), choice.scores, count)

    def fail_over(self, model: str, cause: str | None, tried: int, left: int) -> bool:
        """Whether a request that ``tried`` instances failed, the last for ``cause``, goes on to one of the
        ``left`` others (counted by reason when it does)."""
        if left < 1 or not may_fail_over(cause, tried):
            return False
        self.failovers[(model, str(cause))] += 1
        return True
