"""The real clock."""

from __future__ import annotations

import time

from capyctl.domain.ports import Clock


class SystemClock(Clock):
    def wall(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.monotonic()
