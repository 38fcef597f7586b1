"""Which instance serves a request (``services/routing``): a ready one first, by index; else the first."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import pytest

from capyctl.domain.errors import ApiMismatch, ModelNotFound
from capyctl.services.routing import Router


class Fleet:
    """The deployment ``m`` with the instances given (each a stand-in with ``index`` and ``ready``)."""

    def __init__(self, *ready: bool) -> None:
        self.asked: list[tuple[str, str]] = []
        self._instances = [SimpleNamespace(index=i, ready=r) for i, r in enumerate(ready)]

    def instances(self, model: str, api: str) -> Sequence[Any]:
        self.asked.append((model, api))
        if model != "m":
            raise ModelNotFound(model, ["m"])
        if api != "chat":
            raise ApiMismatch(model, "chat", "/v1/systemone", "POST /v1/chat/completions")
        return self._instances


def test_a_ready_instance_serves_before_one_that_is_not() -> None:
    assert Router(Fleet(False, True, True)).pick("m", "chat").index == 1  # type: ignore[arg-type]


def test_among_ready_instances_the_lowest_index_serves() -> None:
    assert Router(Fleet(True, True)).pick("m", "chat").index == 0  # type: ignore[arg-type]


def test_with_none_ready_the_first_is_asked() -> None:
    fleet = Fleet(False, False)
    assert Router(fleet).pick("m", "chat").index == 0  # type: ignore[arg-type]
    assert fleet.asked == [("m", "chat")]


@pytest.mark.parametrize(("model", "api", "error"), [("x", "chat", ModelNotFound), ("m", "decisions", ApiMismatch)])
def test_what_the_fleet_refuses_is_raised_as_it_is(model: str, api: str, error: type[Exception]) -> None:
    with pytest.raises(error):
        Router(Fleet(True)).pick(model, api)  # type: ignore[arg-type]
