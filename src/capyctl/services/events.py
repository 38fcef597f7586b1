"""Events: every state change, start, crash and restart, stored and logged."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from capyctl.domain.ports import Clock, Store
from capyctl.services.context import caller_request_id

log = logging.getLogger("capyctl.events")


Line = Callable[..., tuple[str, tuple[Any, ...], dict[str, Any]]]  # values -> (format, args, fields)


def usual_line(logger: logging.Logger, line: Line, values: tuple[Any, ...]) -> None:
    """Log ``line(*values)`` through ``logger`` at INFO, the usual way."""
    message, args, extra = line(*values)
    logger.info(message, *args, extra=extra)


class Events:
    """``routine``: how the one log line every request gets is logged, given the logger, the function that
    makes the line (its format, arguments and fields) and that function's values. By default the usual
    way (``usual_line``); ``log_format.routine_line`` hands them to the log writer, which makes the line in
    its own round, when it is the only way out for it."""

    def __init__(
        self, store: Store, clock: Clock, routine: Callable[[logging.Logger, Line, tuple[Any, ...]], None] = usual_line
    ) -> None:
        self._store = store
        self._clock = clock
        self._routine = routine
        self._listeners: list[Callable[[str | None, str, dict[str, Any]], None]] = []
        self._settled: list[Callable[[str, str, float], None]] = []

    def listen(self, listener: Callable[[str | None, str, dict[str, Any]], None]) -> None:
        """Also hand each event to ``listener`` (metrics count parks, wakes, switches this way)."""
        self._listeners.append(listener)

    def on_settled(self, listener: Callable[[str, str, float], None]) -> None:
        """Also tell ``listener`` of each settled cut request: its CapyCTL ID, the rule and the seconds (the
        request records are updated this way; the stored event carries no request ID)."""
        self._settled.append(listener)

    def settled(self, request_id: str, rule: str, seconds: float) -> None:
        for listener in self._settled:
            listener(request_id, rule, seconds)

    def emit(self, deployment: str | None, kind: str, **detail: Any) -> None:
        self._store.add_event(self._clock.wall(), deployment, kind, detail)
        for listener in self._listeners:
            listener(deployment, kind, detail)
        described = "".join(f" {k}={v}" for k, v in detail.items())  # nothing, not a lone space, without fields
        log.info(
            "%s %s%s", kind, deployment or "-", described, extra={"event": kind, "deployment": deployment, **detail}
        )

    def selection(
        self,
        request_id: str,
        deployment: str,
        host: str,
        instance: int,
        key: str | None = None,
        inputs: list[dict[str, Any]] | None = None,
    ) -> None:
        """A request routed to an instance: stored without the caller's ID, logged with it; both name the
        API key it came with (its name, never its secret). ``inputs``: each instance's score and what made it,
        when the deployment has several (stored only).

        The log line is handed to the log at the event loop's next turn, which comes while the engine works
        on the request it is about to be sent: that does not delay the request.
        """
        self._store.add_event(
            self._clock.wall(),
            deployment,
            "router_selection",
            {"capyctl_request_id": request_id, "host": host, "instance": instance, "key": key}
            | ({"inputs": inputs} if inputs is not None else {}),
        )
        values = (request_id, caller_request_id.get(), deployment, host, instance, key)
        try:
            asyncio.get_running_loop().call_soon(self._routine, log, selection_line, values)
        except RuntimeError:  # no asyncio loop (trio in tests): at once
            self._routine(log, selection_line, values)

    def failover(self, request_id: str, deployment: str, host: str, instance: int, reason: str, tries: int) -> None:
        """A request that reached no engine at ``instance`` goes to another one: stored without the caller's
        ID, logged with it."""
        detail = {"capyctl_request_id": request_id, "host": host, "instance": instance, "reason": reason}
        self._store.add_event(self._clock.wall(), deployment, "router_failover", detail | {"tries": tries})
        for listener in self._listeners:
            listener(deployment, "router_failover", detail)
        caller = caller_request_id.get()
        log.info(
            "request %s%s %s: %s instance %d reached no engine (%s); trying another",
            request_id,
            f" (caller {caller})" if caller else "",
            deployment,
            host,
            instance,
            reason,
            extra={"event": "router_failover", "deployment": deployment, "caller_request_id": caller, **detail},
        )


def selection_line(
    request_id: str, caller: str | None, deployment: str, host: str, instance: int, key: str | None
) -> tuple[str, tuple[Any, ...], dict[str, Any]]:
    """The request line of a routed request: its format, arguments and fields."""
    args = (request_id, f" (caller {caller})" if caller else "", deployment, host, instance, key or "-")
    extra = {
        "event": "router_selection",
        "capyctl_request_id": request_id,
        "caller_request_id": caller,
        "deployment": deployment,
        "host": host,
        "instance": instance,
        "key": key,
        "_routine": True,
    }  # a line per request: written with the log writer's next round
    return _SELECTION, args, extra


_SELECTION = "request %s%s %s -> %s instance %d key %s"
