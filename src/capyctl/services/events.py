"""Events: every state change, start, crash and restart, stored and logged."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from capyctl.domain.ports import Clock, Store
from capyctl.services.context import caller_request_id

log = logging.getLogger("capyctl.events")


class Events:
    """``routine``: a way out for the one log line every request gets that skips making its record now
    (``log_format.routine_line``): called with the logger's name, the message and its fields, it returns
    False when the line must be logged the usual way."""

    def __init__(self, store: Store, clock: Clock,
                 routine: Callable[[str, str, dict[str, Any]], bool] | None = None) -> None:
        self._store = store
        self._clock = clock
        self._routine = routine
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
        API key it came with (its name, never its secret).

        The log line is written at the event loop's next turn, which comes while the engine works on the
        request it was just sent: formatting and writing it does not delay the request.
        """
        self._store.add_event(
            self._clock.wall(), deployment, "router_selection",
            {"capyctl_request_id": request_id, "host": host, "instance": instance, "key": key},
        )
        caller = caller_request_id.get()
        try:
            asyncio.get_running_loop().call_soon(self._log_selection, request_id, caller, deployment, host,
                                                 instance, key)
        except RuntimeError:  # no asyncio loop (trio in tests): at once
            self._log_selection(request_id, caller, deployment, host, instance, key)

    def _log_selection(self, request_id: str, caller: str | None, deployment: str, host: str, instance: int,
                       key: str | None) -> None:
        args = (request_id, f" (caller {caller})" if caller else "", deployment, host, instance, key or "-")
        extra = {"event": "router_selection", "capyctl_request_id": request_id, "caller_request_id": caller,
                 "deployment": deployment, "host": host, "instance": instance, "key": key,
                 "_routine": True}  # a line per request: written with the next batch
        if self._routine is None or not self._routine(log.name, _SELECTION % args, extra):
            log.info(_SELECTION, *args, extra=extra)


_SELECTION = "request %s%s %s -> %s instance %d key %s"
