"""A deployment's instances: the engines that serve it, each placed on a machine and a device of its own.

``InstanceSet`` is what the fleet keeps per deployment: the record, one
controller per placed instance (by index), and why any instance could not be
placed. Commands go to every instance alike; what a request asks goes to the
one the router picks (``services/routing.py``).
"""

from __future__ import annotations

import anyio

from capyctl.domain.deployments import Deployment, DeploymentSpec, Desired, InstanceState
from capyctl.domain.engines import EngineInstall
from capyctl.domain.errors import CapyError
from capyctl.services.controllers import Controller, InstanceStatus, initial_desire

S = InstanceState
# The order in which an instance's state stands for its deployment's: the most useful first.
_LEAD = (S.READY, S.WAKING, S.STARTING, S.PARKING, S.PARKED, S.STOPPING, S.UNAVAILABLE, S.FAILED, S.STOPPED)


class InstanceSet:
    def __init__(self, deployment: Deployment, engine: EngineInstall, members: list[Controller]) -> None:
        self.deployment = deployment
        self.engine = engine
        self.members = sorted(members, key=lambda c: c.index)
        self.retired: list[Controller] = []  # instances being replaced: no request goes there; each is dropped
        # once its engine is proven gone (its host drained, lost or revoked)
        self.unplaced: list[str] = []  # why each instance not placed has no place (``domain.placement``)
        self.commanded = initial_desire(deployment)  # what the last command (or apply) asked of every instance

    @property
    def name(self) -> str:
        return self.deployment.spec.name

    @property
    def spec(self) -> DeploymentSpec:
        return self.deployment.spec

    def member(self, index: int) -> Controller | None:
        return next((c for c in [*self.members, *self.retired] if c.index == index), None)

    def free_indexes(self, count: int) -> list[int]:
        """The ``count`` lowest indexes no instance holds (a retired one keeps its own until it is gone)."""
        taken = {c.index for c in [*self.members, *self.retired]}
        out: list[int] = []
        index = 0
        while len(out) < count:
            if index not in taken:
                out.append(index)
            index += 1
        return out

    @property
    def lead(self) -> Controller | None:
        """The instance whose state stands for the deployment's: a ready one before a starting one ..."""
        if not self.members:
            return None
        return min(self.members, key=lambda c: (_LEAD.index(c.status.state), c.index))

    @property
    def state(self) -> InstanceState:
        lead = self.lead
        return S.STOPPED if lead is None else lead.status.state

    @property
    def desired(self) -> Desired:
        """What its lead instance is to bring about (a request's start shows as ``run``); with none placed, what
        the last command asked."""
        lead = self.lead
        return self.commanded if lead is None else lead.desired

    @property
    def ready(self) -> bool:
        """Whether an instance is ready."""
        return any(member.ready for member in self.members)

    @property
    def status(self) -> InstanceStatus:
        lead = self.lead
        return InstanceStatus() if lead is None else lead.status

    # --- commands, to every instance --------------------------------------------------------------
    def want(self, desired: Desired) -> None:
        self.commanded = desired
        for member in self.members:
            member.want(desired)

    def add(self, member: Controller) -> None:
        """A new instance (placed since), told what the others were told."""
        if self.commanded is not Desired.ON_DEMAND:
            member.want(self.commanded)
        self.members = sorted([*self.members, member], key=lambda c: c.index)

    def held(self) -> CapyError | None:
        """Why an instance with an engine running cannot be told to end it now (its host is not online)."""
        for member in self.members:
            if member.status.pid is not None and (refusal := member.held()) is not None:
                return refusal
        return None

    async def until_settled(self) -> None:
        async with anyio.create_task_group() as tg:
            for member in self.members:
                tg.start_soon(member.until_settled)

    async def close(self) -> None:
        """Every instance stopped for good: their engines are gone when this returns (a retired instance is
        being stopped by its own task, which may wait for its host)."""
        async with anyio.create_task_group() as tg:
            for member in self.members:
                tg.start_soon(member.close)
