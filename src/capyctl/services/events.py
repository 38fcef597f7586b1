"""Events: every state change, start, crash and restart, stored and logged."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from capyctl.domain.ports import Clock, Store
from capyctl.services.context import caller_request_id

log = logging.getLogger("capyctl.events")


class Events:
    def __init__(self, store: Store, clock: Clock) -> None:
        self._store = store
        self._clock = clock
        self._listeners: list[Callable[[str | None, str, dict[str, Any]], None]] = []

    def listen(self, listener: Callable[[str | None, str, dict[str, Any]], None]) -> None:
        """Also hand each event to ``listener`` (metrics count parks, wakes, switches this way)."""
        self._listeners.append(listener)

    def emit(self, deployment: str | None, kind: str, **detail: Any) -> None:
        self._store.add_event(self._clock.wall(), deployment, kind, detail)
        for listener in self._listeners:
            listener(deployment, kind, detail)
        described = " ".join(f"{k}={v}" for k, v in detail.items())
        log.info("%s %s %s", kind, deployment or "-", described,
                 extra={"event": kind, "deployment": deployment, **detail})

    def selection(self, request_id: str, deployment: str, host: str, instance: int, key: str | None = None) -> None:
        """A request routed to an instance: stored without the caller's ID, logged with it; both name the
        API key it came with (its name, never its secret)."""
        self._store.add_event(
            self._clock.wall(), deployment, "router_selection",
            {"capyctl_request_id": request_id, "host": host, "instance": instance, "key": key},
        )
        caller = caller_request_id.get()
        log.info(
            "request %s%s %s -> %s instance %d key %s",
            request_id, f" (caller {caller})" if caller else "", deployment, host, instance, key or "-",
            extra={"event": "router_selection", "capyctl_request_id": request_id, "caller_request_id": caller,
                   "deployment": deployment, "host": host, "instance": instance, "key": key},
        )
