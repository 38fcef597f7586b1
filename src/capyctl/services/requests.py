"""One request to a model, and what every API's requests share (chat and decisions alike).

A request is one object, ``Call``, from its last byte in to its last byte
out: its record (it is a ``RequestRecord``), what the front door read, what
CapyCTL holds for it (the admission lease, the route, the engine stream), the
relay's check and meter, and how it ended. The services take it and fill it
in; nothing about a request is handed from one object to another.
``RequestService`` is the part the APIs share: admission and the key's count,
the deadline and idle watch, the settlement of cut requests.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import msgspec

from capyctl.domain.balancing import Score, Unsent
from capyctl.domain.errors import CapyError, DeviceOffline, EdgeError, HostLost
from capyctl.domain.hosts import HostState
from capyctl.domain.metrics import Meter, MetricsRow, metrics_row_for
from capyctl.domain.ports import Clock, EngineAnswer, EngineSession, EngineStream
from capyctl.domain.relay_check import ChunkRules, Refused, StreamCheck
from capyctl.domain.requests import CancelCause, RequestRecord
from capyctl.domain.scheduling import QueueLimits, Route
from capyctl.domain.streams import DEFAULT_MAX_TOOL_CALLS, Chunks, Comment, Relayed, StreamEvent
from capyctl.services.admission import AdmissionService, Lease
from capyctl.services.controllers import Serving
from capyctl.services.events import Events
from capyctl.services.fleet import Fleet
from capyctl.services.keys import Keyring
from capyctl.services.routing import Router

_encode = msgspec.json.encode
_DONE = b"data: [DONE]\n\n"
_GONE = frozenset({HostState.LOST.value, HostState.REVOKED.value})


class RequestSettings(msgspec.Struct, kw_only=True, frozen=True):
    request_deadline: float = 1800.0  # seconds to the engine's first answer, start included
    stream_idle_timeout: float = 120.0  # seconds an answer may go silent once it has begun
    crash_notice: float = 1.0  # how long to wait for a broken connection to show as an engine exit
    max_tool_calls: int = DEFAULT_MAX_TOOL_CALLS  # tool calls in one answer; past it, edge_error
    default_model: str | None = None  # MOD-3: where a request without `model` goes
    host_name: str = "local"  # the machine serving standalone deployments, as logs name it


def _leave(controller: Serving) -> None:
    """A request sent to ``controller``'s engine is over (answered, cut or failed, or written and never
    relayed): counted out there."""
    controller.in_flight -= 1
    controller.left += 1


class Call(RequestRecord, kw_only=True):
    """One request, from its last byte in to its last byte out (see the module's text).

    The services fill it in as the request goes: what the chat service's ``start`` could do at once (the
    deployment's controller, the engine's body, and where nothing had to wait the lease, the route and the
    engine stream, its request written), or the error it found; then the engine's answer, relayed through its
    check; then how it ended. ``close`` gives back what it still holds, once."""

    obj: dict[str, Any]  # the request's body, decoded
    wait: float | None = None  # X-LLM-Wait: seconds it may wait for its model (None: the server's rule)
    received_at: float = 0.0  # the monotonic time its last byte came
    keyring: Keyring | None = None  # holds the key's place for the day until ``close``
    # what CapyCTL holds for it
    controller: Serving | None = None  # the instance it goes to
    scores: list[Score] | None = None  # what the router weighed, when the deployment has several instances
    tried: list[int] = []  # the instances it reached no engine at, in order (failover)
    body: bytes = b""  # what the engine is sent
    lease: Lease | None = None  # granted and not yet entered: ``close`` gives it back
    route: Route | None = None
    engine_stream: EngineStream | None = None  # made and not yet entered: ``close`` cuts it
    counted: Serving | None = None  # the instance ``start`` counted it at, writing it at once (``open`` takes it)
    error: CapyError | None = None  # what ``start`` found, raised when the request goes on
    # the relay
    answer: EngineAnswer | None = None
    check: StreamCheck | None = None
    meter: Meter | None = None
    row: MetricsRow | None = None
    last: bytes | None = None  # the stream's last bytes (its end included), once [DONE] came
    # how it ended
    code: str = "client_gone"
    status: int | None = None  # the status answered, where it is known
    started: bool = False  # the answer's status and headers went out (a stream's 200)
    ttft_ms: float | None = None
    figures: dict[str, Any] | None = None  # the answer's capyctl.metrics
    usage: dict[str, Any] | None = None  # the answer's usage, as the engine reported it

    def close(self) -> None:
        """Give back what was never used (``give_back``), and the key's place for the day when no engine
        used it. Once the request is answered."""
        self.give_back()
        if self.keyring is not None:
            self.keyring.done(self.id)
            self.keyring = None

    def give_back(self) -> None:
        """Give back a granted lease never entered and cut a written request never entered."""
        if self.engine_stream is not None:
            self.engine_stream.abandon()
            self.engine_stream = None
        if self.counted is not None:  # written at once and never relayed: it has left its instance
            _leave(self.counted)
            self.counted = None
        if self.lease is not None:
            self.lease.give_back()
            self.lease = None

    def measured(self, figures: dict[str, Any], usage: Any) -> None:
        """An answer's figures (``capyctl.metrics``) and the engine's ``usage``, for its record."""
        self.figures, self.usage = figures, usage if isinstance(usage, dict) else None
        self.ttft_ms = figures.get("ttft_ms", {}).get("value")

    # -- the relay ------------------------------------------------------------------------------------
    @property
    def failure(self) -> dict[str, Any] | None:
        """The engine's own error event, when it sent one (the stream then ends without metrics)."""
        return self.check.failure if self.check is not None else None

    async def pump(self, write: Callable[[bytes], bool], drain: Callable[[], Awaitable[None]]) -> bytes:
        """Relay the answer: each read's events checked and framed as SSE, handed to ``write`` as the read
        arrives (``write`` returns True when its client cannot take more for now: reading then pauses until
        ``drain()`` returns). The read that holds ``[DONE]`` is not written: its bytes, with the metrics line
        and ``[DONE]``, are returned, for the caller to send with the end of its answer.

        Raises as the check refuses a chunk (after writing the chunks before it), ``EdgeError`` when the
        answer ends without ``[DONE]`` (unless it ended on the engine's own error event), and as the
        engine's connection breaks."""

        def deliver(batch: list[StreamEvent]) -> Relayed:
            try:
                data = self.frame(batch)
            except Refused as refused:
                if refused.sent:
                    write(refused.sent)
                raise refused.error from refused.error.__cause__
            if self.last is not None:
                return Relayed.ENDED
            return Relayed.FULL if data and write(data) else Relayed.MORE

        assert self.answer is not None, "pump() runs inside the chat service's open()"
        if not await self.answer.pump(deliver, drain) and self.failure is None:
            raise EdgeError("the engine's stream ended without [DONE]")
        return self.last if self.last is not None else b""

    def frame(self, batch: list[StreamEvent]) -> bytes:
        """A batch of events as the SSE bytes sent on (see ``pump``); raises ``Refused``."""
        check = self.check
        assert check is not None, "frame() runs inside the chat service's open()"
        if len(batch) == 1 and type(first := batch[0]) is Chunks:  # the most usual batch
            data = check.check(first)
            if not self.answered:
                self._note_answer(check)
            return data
        parts: list[bytes] = []
        for event in batch:
            if type(event) is Chunks:
                try:
                    parts.append(check.check(event))
                except Refused as refused:
                    raise Refused(b"".join(parts) + refused.sent, refused.error) from refused.error.__cause__
                if not self.answered:
                    self._note_answer(check)
            elif type(event) is Comment:
                parts += (event.raw, b"\n\n")
            else:  # Done
                if check.failure is None:  # an answer that ended on the engine's error has no metrics
                    parts += (b": x-capyctl-metrics ", _encode(self.metrics()), b"\n\n")
                parts.append(_DONE)
                self.last = b"".join(parts)
                return self.last
        return b"".join(parts)

    def _note_answer(self, check: StreamCheck) -> None:
        """The record told that the engine answered, once its first text or its own error came."""
        if (self.meter is not None and self.meter.first_text_at is not None) or check.failure is not None:
            self.engine_answered()

    def metrics(self) -> dict[str, dict[str, Any]]:
        assert self.meter is not None and self.row is not None, "metrics() follows the relay"
        return self.meter.figures(self.row)

    @property
    def seen_usage(self) -> Any:
        """The engine's ``usage`` object, when its stream carried one."""
        return self.meter.seen.get("usage") if self.meter is not None else None


class RequestService:
    """What every API's requests share: admission (and the key's count), the deadline and idle watch,
    settlement of cut requests."""

    def __init__(
        self,
        fleet: Fleet,
        session: EngineSession,
        clock: Clock,
        events: Events,
        settings: RequestSettings,
        admission: AdmissionService | None = None,
        keys: Keyring | None = None,
        router: Router | None = None,
    ) -> None:
        self._fleet = fleet
        self._keys = keys
        self._admission = admission or AdmissionService(QueueLimits(), clock, settings.request_deadline)
        self.router = router or Router(fleet, clock, self._admission.state.limits.max_in_flight_per_instance)
        self._events = events
        self._session = session
        self._clock = clock
        self._settings = settings
        self.live: dict[str, Call] = {}  # requests being served, read by the metrics endpoint
        self._rules: dict[tuple[str, str], tuple[ChunkRules, MetricsRow]] = {}  # a relay's, per engine version

    @property
    def check_every(self) -> float:
        """How often ``overdue`` should be asked: a tenth of the shortest limit, within 50 ms..1 s."""
        settings = self._settings
        return min(1.0, max(0.05, min(settings.request_deadline, settings.stream_idle_timeout) / 10))

    def overdue(self, call: Call) -> bool:
        """CAN-1: True (and ``call`` marked cancelled) once it has had no answer within the request deadline,
        or once its answer has been silent for the stream idle timeout, or once the host its engine runs on
        is lost. Cheap: no I/O."""
        if call.instance is not None and _host_gone(call.controller):
            call.cancelled(CancelCause.HOST_LOST)
            return True
        now = self._clock.monotonic()
        if not call.answered:
            if now - call.received_at > self._settings.request_deadline:
                call.cancelled(CancelCause.DEADLINE)
                return True
            return False
        meter = call.meter
        if meter is not None and meter.last_at is not None and now - meter.last_at > self._settings.stream_idle_timeout:
            call.cancelled(CancelCause.IDLE)
            return True
        return False

    def now(self) -> float:
        return self._clock.monotonic()

    @property
    def default_model(self) -> str | None:
        return self._settings.default_model

    def cut(self, call: Call) -> None:
        """CAN-2: a request cut after it was sent stays counted against its instance until settled (unless its
        deployment was deleted meanwhile)."""
        if call.instance is not None and call.controller is not None and self._fleet.has(call.deployment):
            call.controller.cut(call)

    def knows(self, name: str) -> bool:
        return self._fleet.has(name)

    def names(self) -> list[str]:
        return self._fleet.names()

    def _lease(self, controller: Serving, call: Call) -> tuple[Lease, bool]:
        """The call's admission lease, taken from it (``async with`` it), and whether it was granted already
        (``start``'s, its key's count made); else one that waits in line."""
        lease = call.lease
        if lease is not None:
            call.lease = None
            return lease, True
        return self._admission.admit(controller, call, call.wait), False

    def _counted(self, call: Call) -> None:
        """Once its lease is granted, the call counts against its key's day (ID-5)."""
        if self._keys is not None:
            self._keys.admitted(call.id)

    def _pick(self, call: Call, api: str) -> Serving:
        """The instance ``call`` goes to (not one it reached no engine at), for the router's reasons; its
        deployment's waiting line takes as many requests at once as it has instances."""
        picked = self.router.pick(call.deployment, api, call.tried)
        self._admission.state.scale(call.deployment, picked.size)
        call.controller, call.scores = picked.instance, picked.scores
        return picked.instance

    def _fail_over(self, call: Call, api: str, cause: str | None) -> Serving | None:
        """After ``call`` reached no engine at its instance (for ``cause``): the next instance to try, with a
        ``router_failover`` event; None when it may not move on (it then ends with ``error``)."""
        failed = call.controller
        assert failed is not None
        try:
            left = len(self._fleet.instances(call.deployment, api)) - len(call.tried) - 1
        except CapyError:  # (deleted, or stopped, meanwhile)
            return None
        if not self.router.fail_over(call.deployment, cause, len(call.tried) + 1, left):
            return None
        call.tried = [*call.tried, failed.index]
        host = failed.host or self._settings.host_name
        self._events.failover(call.id, call.deployment, host, failed.index, str(cause), len(call.tried))
        try:
            return self._pick(call, api)
        except CapyError:
            return None

    async def _routed(self, call: Call, api: str, controller: Serving) -> tuple[Serving, Route]:
        """``controller``'s route once its engine is ready (waiting for it if need be); when its host was out of
        reach as the request was routed, another instance's (failover, cause ``host_away``), while one is left."""
        while True:
            try:
                return controller, await controller.route(self._settings.request_deadline)
            except (DeviceOffline, HostLost):
                nxt = self._fail_over(call, api, Unsent.HOST_AWAY)
                if nxt is None:
                    raise
                controller = nxt

    def _selected(self, call: Call, controller: Serving) -> None:
        """``call`` is sent to ``controller``'s engine now: counted there until ``_left``."""
        index = controller.index
        call.sent(instance=index)
        controller.in_flight += 1
        self.router.selections[(call.deployment, index)] += 1
        scores = call.scores
        inputs = None if scores is None else [s._asdict() for s in scores]
        host = controller.host or self._settings.host_name
        self._events.selection(call.id, call.deployment, host, index, call.key, inputs)

    @staticmethod
    def _of_instance(error: CapyError, controller: Serving) -> CapyError:
        """``error`` (what ended a request an engine may have seen) naming the instance it was at, when its
        host is out of reach (``device_offline``): the request is not sent again, its client is told where."""
        if error.code == "device_offline":
            error.extra["instance"] = controller.index
        return error

    _left = staticmethod(_leave)  # a request sent to an instance's engine is over

    def _arm(self, call: Call, controller: Serving) -> None:
        """The call's meter and check (the rules made once per engine version)."""
        engine = controller.engine
        made = self._rules.get((engine.family, engine.version))
        if made is None:
            made = self._rules[(engine.family, engine.version)] = (
                ChunkRules(controller.fields.row, f"{engine.family} {engine.version}", self._settings.max_tool_calls),
                metrics_row_for(engine.family, engine.version),
            )
        rules, call.row = made
        call.meter = meter = Meter(self._clock.monotonic)
        call.check = StreamCheck(rules, meter, call.deployment, self._clock.monotonic)


def _host_gone(controller: Serving | None) -> bool:
    """Whether the host of ``controller``'s engine is lost or revoked now (what its ``held`` says): a request
    sent there is cut (CAN-1); one merely suspended or reconnecting may still be answered."""
    held = controller.held() if controller is not None else None
    return isinstance(held, DeviceOffline) and held.state in _GONE
