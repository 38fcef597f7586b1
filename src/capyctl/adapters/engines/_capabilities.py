"""What an engine family can do, where its adapter needs no code of its own: parking, decisions.

``RestartOnly``: an engine with no sleep parks by stopping. CapyCTL never
asks it to sleep or wake, since applying any other residency to it is
refused; these answers are for an adapter's completeness.
``DecisionsByVersion``: whether the installation answers ``/v1/systemone``,
from the domain's table of families and versions.
"""

from __future__ import annotations

from capyctl.domain.decisions import serves_decisions
from capyctl.domain.engines import EngineInstall
from capyctl.domain.errors import InvalidConfig
from capyctl.domain.memory import Residency


class RestartOnly:
    family: str

    async def park(self, base_url: str, residency: Residency) -> None:
        raise InvalidConfig(f"{self.family} parks by stopping (residency restart_only)")

    async def wake(self, base_url: str, residency: Residency, model: str) -> None:
        raise InvalidConfig(f"{self.family} parks by stopping (residency restart_only)")

    async def parked(self, base_url: str) -> bool | None:
        return None


class DecisionsByVersion:
    """Whether an installation serves ``POST /v1/systemone``, from its family and version."""

    family: str

    def serves_decisions(self, engine: EngineInstall) -> bool:
        return bool(serves_decisions(str(self.family), engine.version))
