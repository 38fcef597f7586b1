"""Which instance serves a request (``services/routing``): the least loaded of those that take requests, ties
taking turns, a draining or unreachable or already tried one left aside; and when a request may move on."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest

from capyctl.domain.balancing import Sample, Unsent
from capyctl.domain.errors import ApiMismatch, DeviceOffline, ModelNotFound
from capyctl.services.routing import Router
from tests.fakes.ports import FakeClock


class Instance:
    """A stand-in for an instance: what the router reads of it."""

    def __init__(self, index: int, ready: bool = True, in_flight: int = 0, held: bool = False) -> None:
        self.index, self._ready, self.in_flight, self._held = index, ready, in_flight, held
        self.draining = False
        self.sample: Sample | None = None
        self.left = 0

    def route_now(self) -> object | None:
        return object() if self._ready and not self._held else None

    def held(self) -> DeviceOffline | None:
        return DeviceOffline("gpu-a", "suspended", model="m") if self._held else None


class Fleet:
    """The deployment ``m`` with the instances given."""

    def __init__(self, *instances: Instance) -> None:
        self.asked: list[tuple[str, str]] = []
        self.members = list(instances)

    def instances(self, model: str, api: str) -> Sequence[Any]:
        self.asked.append((model, api))
        if model != "m":
            raise ModelNotFound(model, ["m"])
        if api != "chat":
            raise ApiMismatch(model, "chat", "/v1/systemone", "POST /v1/chat/completions")
        return self.members


def router(*instances: Instance) -> Router:
    return Router(Fleet(*instances), FakeClock(), 32)  # type: ignore[arg-type]


def test_one_instance_is_taken_at_once_with_nothing_weighed() -> None:
    picked = router(Instance(0, ready=False)).pick("m", "chat")
    assert (picked.instance.index, picked.scores, picked.size) == (0, None, 1)


def test_the_least_loaded_ready_instance_serves_and_its_inputs_are_given() -> None:
    picked = router(Instance(0, in_flight=3), Instance(1, in_flight=1), Instance(2, ready=False)).pick("m", "chat")
    assert picked.instance.index == 1 and picked.size == 3
    assert picked.scores is not None and [(s.instance, s.score) for s in picked.scores] == [(0, 3), (1, 1), (2, 32)]


def test_equal_instances_take_turns() -> None:
    r = router(Instance(0), Instance(1), Instance(2))
    assert Counter(r.pick("m", "chat").instance.index for _ in range(30)) == {0: 10, 1: 10, 2: 10}


def test_a_draining_an_unreachable_or_a_tried_instance_is_left_aside_while_another_can_serve() -> None:
    draining = Instance(0)
    draining.draining = True
    r = router(draining, Instance(1, held=True), Instance(2, in_flight=9), Instance(3, in_flight=20))
    assert {r.pick("m", "chat").instance.index for _ in range(5)} == {2}
    assert r.pick("m", "chat", tried=[2]).instance.index == 3
    assert r.pick("m", "chat", tried=[2, 3]).instance.index == 0  # the others left: a draining one still serves


def test_with_none_ready_the_first_is_asked() -> None:
    assert router(Instance(0, ready=False), Instance(1, ready=False)).pick("m", "chat").instance.index == 0


@pytest.mark.parametrize(("model", "api", "error"), [("x", "chat", ModelNotFound), ("m", "decisions", ApiMismatch)])
def test_what_the_fleet_refuses_is_raised_as_it_is(model: str, api: str, error: type[Exception]) -> None:
    with pytest.raises(error):
        router(Instance(0)).pick(model, api)


def test_a_failover_is_allowed_only_before_acceptance_while_another_instance_is_left() -> None:
    r = router(Instance(0), Instance(1))
    assert r.fail_over("m", Unsent.REFUSED, tried=1, left=1)
    assert not r.fail_over("m", Unsent.REFUSED, tried=2, left=0)  # none left
    assert not r.fail_over("m", None, tried=1, left=1)  # an engine may have seen it
    assert not r.fail_over("m", Unsent.TLS, tried=4, left=3)  # four tries at most
    assert r.fail_over("m", Unsent.GATE_CLOSED, tried=1, left=2)
    assert r.failovers == {("m", "connection_refused"): 1, ("m", "gate_closed"): 1}
