"""Deployments: what an operator asked for, and the states an instance moves through.

A deployment is the operator's YAML (``DeploymentSpec``, decoded strictly) plus
one sticky flag: whether an operator stopped it. Its instances are the engine
processes serving it. The legal state changes are one table, ``TRANSITIONS``;
the supervisor asks ``check_transition`` before it moves an instance.
"""

from __future__ import annotations

import enum
import re
from typing import Literal

import msgspec

from capyctl.domain.errors import InvalidConfig

NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


class Strict(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """Base of everything CapyCTL owns: an unknown key is an error, never ignored.

    A typo in a deployment file (``contxt_length``) must be refused with its
    name, or the operator believes a setting that nothing applies.
    """


class EngineConfig(Strict):
    context_length: int | None = None
    extra_args: list[str] = []


class DeploymentSpec(Strict):
    name: str
    engine: str
    model: str
    api: Literal["chat", "decisions"] = "chat"
    engine_config: EngineConfig = EngineConfig()

    def __post_init__(self) -> None:
        if not NAME_PATTERN.match(self.name):
            raise InvalidConfig(
                f"deployment name {self.name!r} is not valid: use 1-64 letters, digits, '.', '_' "
                "or '-', starting with a letter or digit"
            )
        if self.engine_config.context_length is not None and self.engine_config.context_length <= 0:
            raise InvalidConfig("engine_config.context_length must be a positive number of tokens")


def check_extra_args(extra_args: list[str], owned: dict[str, str]) -> None:
    """Refuse engine options CapyCTL sets itself (``owned`` maps flag -> what it controls)."""
    for arg in extra_args:
        flag = arg.split("=", 1)[0]
        if flag in owned:
            raise InvalidConfig(
                f"engine_config.extra_args: {flag} is set by CapyCTL ({owned[flag]}) and cannot be "
                "overridden; remove it from the deployment file"
            )


class InstanceState(enum.StrEnum):
    STOPPED = "stopped"
    STARTING = "starting"
    READY = "ready"
    STOPPING = "stopping"
    FAILED = "failed"


S = InstanceState
TRANSITIONS: dict[InstanceState, frozenset[InstanceState]] = {
    S.STOPPED: frozenset({S.STARTING}),
    S.STARTING: frozenset({S.READY, S.STOPPING, S.FAILED, S.STARTING}),
    S.READY: frozenset({S.STOPPING, S.STARTING}),  # READY -> STARTING: crash, restart
    S.STOPPING: frozenset({S.STOPPED}),
    S.FAILED: frozenset({S.STARTING, S.STOPPING, S.STOPPED}),
}


def check_transition(current: InstanceState, new: InstanceState) -> None:
    if new not in TRANSITIONS[current]:
        raise ValueError(f"illegal instance transition {current} -> {new}")


class Deployment(msgspec.Struct, kw_only=True):
    spec: DeploymentSpec
    operator_stopped: bool = False


def restart_delay(consecutive_failures: int, base: float = 0.5, ceiling: float = 30.0) -> float:
    """Backoff before restarting a crashed engine: 0.5 s, 1 s, 2 s ... at most 30 s."""
    return min(ceiling, base * (2 ** max(0, consecutive_failures - 1)))
