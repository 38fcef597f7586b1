"""The real clock."""

from __future__ import annotations

import time

from capyctl.domain.ports import Clock


class SystemClock(Clock):
    """``time.time`` and ``time.monotonic`` themselves: a request reads the clock a dozen times, and each
    read through a method of this class cost a Python call around the C one."""

    __slots__ = ()

    wall = staticmethod(time.time)
    monotonic = staticmethod(time.monotonic)
