"""Events: every state change, start, crash and restart, stored and logged."""

from __future__ import annotations

import logging
from typing import Any

from capyctl.domain.ports import Clock, Store

log = logging.getLogger("capyctl.events")


class Events:
    def __init__(self, store: Store, clock: Clock) -> None:
        self._store = store
        self._clock = clock

    def emit(self, deployment: str | None, kind: str, **detail: Any) -> None:
        self._store.add_event(self._clock.wall(), deployment, kind, detail)
        described = " ".join(f"{k}={v}" for k, v in detail.items())
        log.info("%s %s %s", kind, deployment or "-", described, extra={"event": kind, **detail})
