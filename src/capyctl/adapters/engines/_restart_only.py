"""Parking for an engine that has no sleep: it parks by stopping (residency restart_only, LIFE-2).

CapyCTL never asks such an engine to sleep or wake, since applying any other
residency to it is refused; these answers are for an adapter's completeness.
"""

from __future__ import annotations

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
