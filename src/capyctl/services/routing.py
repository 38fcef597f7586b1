"""Which instance of a deployment serves a request: the one place between the fleet and the request services
where the choice is made (and where balancing and failover belong as instances multiply).

The rule today: a ready instance before any other, the lowest index first; when none is ready, the first
(asking it starts or wakes it). The fleet checks the deployment (its name, its API, an operator's stop).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from capyctl.services.controllers import Serving


class Instances(Protocol):
    def instances(self, model: str, api: str) -> Sequence[Serving]:
        """The instances of deployment ``model`` that may serve a request of ``api``, by index; raises for a
        deployment that cannot (unknown, another API, stopped by an operator)."""


class Router:
    def __init__(self, fleet: Instances) -> None:
        self._fleet = fleet

    def pick(self, model: str, api: str) -> Serving:
        """The instance a request of ``api`` for ``model`` goes to (see the module)."""
        instances = self._fleet.instances(model, api)
        for instance in instances:
            if instance.ready:
                return instance
        return instances[0]
