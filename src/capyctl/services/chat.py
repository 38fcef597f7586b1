"""A chat request's way through CapyCTL: resolve, make ready, ask the engine, relay.

CapyCTL always asks the engine for a stream (CHAT-2): a non-streamed request
is assembled here, so it is cancelled exactly like a stream. For a
non-streamed request usage is asked for; a streamed one keeps the client's
``stream_options``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import msgspec

from capyctl.domain.engines import EngineFamily
from capyctl.domain.errors import (
    CacheSaltUnsupported,
    CapyError,
    EdgeError,
    EngineError,
    EngineUnavailable,
    InvalidJson,
    InvalidRequest,
    engine_code,
)
from capyctl.domain.metrics import Meter, MetricsRow, metrics_row_for
from capyctl.domain.ports import Clock, EngineAnswer, EngineSession, EngineStream
from capyctl.domain.relay_check import ChunkRules, Refused, StreamCheck
from capyctl.domain.requests import CancelCause, Phase, RequestRecord
from capyctl.domain.scheduling import QueueLimits, Route
from capyctl.domain.streams import DEFAULT_MAX_TOOL_CALLS, Assembler, Chunks, Comment, Relayed, StreamEvent, payloads_of
from capyctl.services.admission import AdmissionService, Lease
from capyctl.services.controllers import Serving
from capyctl.services.events import Events
from capyctl.services.fleet import Fleet
from capyctl.services.keys import Keyring

_encode = msgspec.json.encode
_decode = msgspec.json.Decoder(dict[str, Any]).decode
_DONE = b"data: [DONE]\n\n"
SALTED_FAMILIES = frozenset({EngineFamily.VLLM, EngineFamily.SGLANG})  # engines that honour cache_salt


class ChatSettings(msgspec.Struct, kw_only=True, frozen=True):
    request_deadline: float = 1800.0  # seconds to the engine's first answer, start included
    stream_idle_timeout: float = 120.0  # seconds an answer may go silent once it has begun
    crash_notice: float = 1.0  # how long to wait for a broken connection to show as an engine exit
    max_tool_calls: int = DEFAULT_MAX_TOOL_CALLS  # tool calls in one answer; past it, edge_error
    default_model: str | None = None  # MOD-3: where a request without `model` goes
    host_name: str = "local"  # the machine serving standalone deployments, as logs name it


def read_target(obj: dict[str, Any], default_model: str | None = None) -> tuple[str, bool]:
    """The model name and whether the client wants a stream; refuses what CapyCTL cannot serve.

    A request without ``model`` goes to the server's ``default_model`` when it has one (MOD-3).
    """
    model = obj.get("model")
    if model is None and default_model is not None:
        model = default_model
    if not isinstance(model, str) or not model:
        hint = "" if default_model else "; this server has no default_model"
        raise InvalidRequest(f"'model' is required: the name of a deployment (see GET /v1/models){hint}", param="model")
    stream = obj.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be true or false", param="stream")
    return model, stream


def engine_body(obj: dict[str, Any], served_name: str, client_stream: bool) -> bytes:
    body = dict(obj)
    body["model"] = served_name
    body["stream"] = True
    if not client_stream:
        body["stream_options"] = {"include_usage": True}
    try:
        return _encode(body)
    except RecursionError as exc:  # decoded just under the limit, deeper in the stack than this
        raise InvalidJson("JSON nested too deeply (CapyCTL relays up to several hundred levels)") from exc


def failure_error(error: dict[str, Any]) -> EngineError:
    """An engine's mid-stream error event as an error answer: its own code kept (``type`` equals it)."""
    code = error.get("code")
    status = code if isinstance(code, int) and 400 <= code <= 599 else 500
    extra = {k: v for k, v in error.items() if k not in ("message", "type", "code")}
    return EngineError(status, str(error.get("message") or "the engine failed"), engine_code(error), extra)


class RequestService:
    """What every API's requests share: admission (and the key's count), the deadline and idle watch,
    settlement of cut requests."""

    def __init__(
        self,
        fleet: Fleet,
        session: EngineSession,
        clock: Clock,
        events: Events,
        settings: ChatSettings,
        admission: AdmissionService | None = None,
        keys: Keyring | None = None,
    ) -> None:
        self._fleet = fleet
        self._keys = keys
        self._admission = admission or AdmissionService(QueueLimits(), clock, settings.request_deadline)
        self._events = events
        self._session = session
        self._clock = clock
        self._settings = settings
        self.live: dict[str, RequestRecord] = {}  # requests being served, read by the metrics endpoint
        self._meters: dict[str, Meter] = {}  # the engine activity of requests being relayed

    @property
    def check_every(self) -> float:
        """How often ``overdue`` should be asked: a tenth of the shortest limit, within 50 ms..1 s."""
        settings = self._settings
        return min(1.0, max(0.05, min(settings.request_deadline, settings.stream_idle_timeout) / 10))

    def overdue(self, record: RequestRecord, received_at: float) -> bool:
        """CAN-1: True (and ``record`` marked cancelled) once it has had no answer within the request
        deadline, or once its answer has been silent for the stream idle timeout, or once the host its engine
        runs on is lost. Cheap: no I/O."""
        if record.instance is not None and self._fleet.lost_host(record.deployment):
            record.cancelled(CancelCause.HOST_LOST)
            return True
        now = self._clock.monotonic()
        if not record.answered:
            if now - received_at > self._settings.request_deadline:
                record.cancelled(CancelCause.DEADLINE)
                return True
            return False
        meter = self._meters.get(record.id)
        if meter is not None and meter.last_at is not None and now - meter.last_at > self._settings.stream_idle_timeout:
            record.cancelled(CancelCause.IDLE)
            return True
        return False

    def now(self) -> float:
        return self._clock.monotonic()

    @property
    def default_model(self) -> str | None:
        return self._settings.default_model

    def cut(self, record: RequestRecord) -> None:
        """CAN-2: a request cut after it was sent stays counted against its instance until settled."""
        if record.instance is not None and self._fleet.has(record.deployment):
            self._fleet.get(record.deployment).cut(record)

    def knows(self, name: str) -> bool:
        return self._fleet.has(name)

    def names(self) -> list[str]:
        return self._fleet.names()

    def _admitted(self, controller: Serving, record: RequestRecord, wait: float | None) -> _Admitted:
        """Admission's lease for ``record``; once granted, the call counts against its key's day (ID-5)."""
        return _Admitted(self._admission.admit(controller, record, wait), self._keys, record.id)

    def _selected(self, record: RequestRecord, controller: Serving) -> None:
        record.sent(instance=0)
        self._events.selection(record.id, record.deployment, controller.host or self._settings.host_name, 0, record.key)


class ChatService(RequestService):
    def __init__(
        self,
        fleet: Fleet,
        session: EngineSession,
        clock: Clock,
        events: Events,
        settings: ChatSettings,
        admission: AdmissionService | None = None,
        keys: Keyring | None = None,
    ) -> None:
        super().__init__(fleet, session, clock, events, settings, admission, keys)
        self._rules: dict[tuple[str, str], tuple[ChunkRules, MetricsRow]] = {}  # per engine version

    def start(self, record: RequestRecord, obj: dict[str, Any]) -> Started:
        """A request's first steps, done at once as its last byte arrives (no wait, no I/O but one write):
        the deployment resolved and the engine's body made; where nothing has to wait (the model ready, a
        place free), the admission granted and the request written to its engine, when a kept-alive
        connection to it stands idle. Never raises: an error is kept for ``open`` to raise, and what was
        not done here ``open`` does. Whatever ``open`` does not take up, ``Started.close`` gives back."""
        started = Started()
        try:
            controller: Serving = self._fleet.resolve(record.deployment, "chat")
            check_cache_salt(obj, controller.engine.family, record.key if record.salt_bound else None)
            started.controller, started.body = controller, engine_body(obj, controller.spec.served_model, record.stream)
            route = controller.route_now()
            lease = self._admission.admit_now(controller, record) if route is not None else None
            if lease is None:
                return started
            started.lease = lease
            if self._keys is not None:
                self._keys.admitted(record.id)
        except CapyError as error:
            started.close()
            started.error = error
            return started
        except BaseException:
            started.close()
            raise
        started.route = route
        started.stream = self._session.chat_stream(route.url, started.body)
        return started

    @asynccontextmanager
    async def open(
        self, record: RequestRecord, obj: dict[str, Any], wait: float | None = None, started: Started | None = None
    ) -> AsyncIterator[EngineCall]:
        """Yield the engine call answering ``obj``: its relayed events, and its metrics at the end.

        Raises domain errors before anything is yielded (unknown model, engine refusal ...). Leaving the
        context closes the engine connection. Takes up from what ``start`` did (``started``), or starts.
        """
        started = started or self.start(record, obj)
        if started.error is not None:
            raise started.error
        controller, body = started.controller, started.body
        lease, route, stream = started.take()
        self.live[record.id] = record
        try:
            if lease is None:
                record.phase = Phase.WAITING
                lease = self._admitted(controller, record, wait)
            async with lease:
                if route is None:
                    route = await controller.route(self._settings.request_deadline)  # granted: ready, unless it fell
                if (
                    stream is None
                ):  # (the session may write the request at once: the rest is done while the engine works)
                    stream = self._session.chat_stream(route.url, body)
                try:
                    self._selected(record, controller)
                    meter = self._meters[record.id] = Meter(self._clock.monotonic)
                except BaseException:
                    stream.abandon()
                    raise
                streaming = False
                try:
                    async with stream as answer:
                        streaming = True
                        yield self._call(controller, record, meter, answer)
                except EngineUnavailable as exc:
                    # stopped, or crashed and restarting
                    gone = await controller.lost(route, self._settings.crash_notice, exc)
                    if gone is not None:
                        raise gone from exc
                    if streaming:  # the engine is still there, but its answer broke off
                        raise EdgeError(
                            f"the engine's connection broke before the end of its stream ({exc.message})"
                        ) from exc
                    raise
                finally:
                    self._meters.pop(record.id, None)
        finally:
            del self.live[record.id]

    def _call(self, controller: Serving, record: RequestRecord, meter: Meter, answer: EngineAnswer) -> EngineCall:
        """The engine call over ``answer``, with its check (the rules made once per engine version)."""
        engine = controller.engine
        made = self._rules.get((engine.family, engine.version))
        if made is None:
            made = self._rules[(engine.family, engine.version)] = (
                ChunkRules(controller.fields.row, f"{engine.family} {engine.version}", self._settings.max_tool_calls),
                metrics_row_for(engine.family, engine.version),
            )
        rules, row = made
        return EngineCall(
            answer, StreamCheck(rules, meter, record.deployment, self._clock.monotonic), meter, row, record
        )

    async def complete(
        self, record: RequestRecord, obj: dict[str, Any], wait: float | None = None, started: Started | None = None
    ) -> dict[str, Any]:
        """A non-streamed answer, assembled from the engine's stream as the relay checked it, with
        ``capyctl.metrics``."""
        parts: list[bytes] = []
        async with self.open(record, obj, wait, started) as call:
            parts.append(await call.pump(lambda data: parts.append(data) is not None, anyio.lowlevel.checkpoint))
        if call.failure is not None:
            raise failure_error(call.failure)
        assembler = Assembler(record.deployment, self._settings.max_tool_calls)
        for payload in payloads_of(b"".join(parts)):
            try:
                chunk = _decode(payload)
            except (msgspec.DecodeError, RecursionError) as error:  # what the check relays unread (1e999)
                raise EdgeError(f"the engine sent a chunk CapyCTL cannot assemble into an answer: {error}") from error
            assembler.add(chunk)
        answer = assembler.result()
        answer["capyctl"] = {"metrics": call.metrics()}
        return answer


class Started:
    """What ``ChatService.start`` did for a request: the deployment and the engine's body, and where nothing
    had to wait, the lease (granted), the route and the engine stream (its request written when a
    connection stood idle); or the error ``open`` raises."""

    __slots__ = ("controller", "body", "lease", "route", "stream", "error")

    def __init__(self) -> None:
        self.controller: Any = None
        self.body = b""
        self.lease: Lease | None = None
        self.route: Route | None = None
        self.stream: EngineStream | None = None
        self.error: CapyError | None = None

    def take(self) -> tuple[Lease | None, Route | None, EngineStream | None]:
        """What ``open`` takes up (and so ``close`` no longer gives back)."""
        taken = self.lease, self.route, self.stream
        self.lease = self.route = self.stream = None
        return taken

    def close(self) -> None:
        """Give back what was never taken up: the lease returned, a written request cut."""
        if self.stream is not None:
            self.stream.abandon()
            self.stream = None
        if self.lease is not None:
            self.lease.give_back()
            self.lease = None


class EngineCall:
    """One engine call in progress: its answer relayed through its check, then its metrics."""

    __slots__ = ("_answer", "_check", "_meter", "_row", "_record", "last")

    def __init__(
        self, answer: EngineAnswer, check: StreamCheck, meter: Meter, row: MetricsRow, record: RequestRecord
    ) -> None:
        self._answer = answer
        self._check = check
        self._meter = meter
        self._row = row
        self._record = record
        self.last: bytes | None = None  # the stream's last bytes (its end included), once [DONE] came

    @property
    def failure(self) -> dict[str, Any] | None:
        """The engine's own error event, when it sent one (the stream then ends without metrics)."""
        return self._check.failure

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

        if not await self._answer.pump(deliver, drain) and self._check.failure is None:
            raise EdgeError("the engine's stream ended without [DONE]")
        return self.last if self.last is not None else b""

    def frame(self, batch: list[StreamEvent]) -> bytes:
        """A batch of events as the SSE bytes sent on (see ``pump``); raises ``Refused``."""
        check, record = self._check, self._record
        if len(batch) == 1 and type(batch[0]) is Chunks:  # the most usual batch
            data = check.check(batch[0])  # type: ignore[arg-type]
            if not record.answered:
                self._note_answer()
            return data
        parts: list[bytes] = []
        for event in batch:
            if type(event) is Chunks:
                try:
                    parts.append(check.check(event))
                except Refused as refused:
                    raise Refused(b"".join(parts) + refused.sent, refused.error) from refused.error.__cause__
                if not record.answered:
                    self._note_answer()
            elif type(event) is Comment:
                parts += (event.raw, b"\n\n")  # type: ignore[union-attr]
            else:  # Done
                if check.failure is None:  # an answer that ended on the engine's error has no metrics
                    parts += (b": x-capyctl-metrics ", _encode(self.metrics()), b"\n\n")
                parts.append(_DONE)
                self.last = b"".join(parts)
                return self.last
        return b"".join(parts)

    def _note_answer(self) -> None:
        """The record told that the engine answered, once its first text or its own error came."""
        if self._meter.first_text_at is not None or self._check.failure is not None:
            self._record.engine_answered()

    def metrics(self) -> dict[str, dict[str, Any]]:
        return self._meter.figures(self._row)

    @property
    def usage(self) -> Any:
        """The engine's ``usage`` object, when its stream carried one."""
        return self._meter.seen.get("usage")


def check_cache_salt(obj: dict[str, Any], family: str, bound_by: str | None = None) -> None:
    """SALT-1/SALT-2: a valid salt, and only for engines that partition their cache by it
    (``bound_by``: the key whose salt it is, when a key binds one)."""
    if "cache_salt" not in obj:
        return
    salt = obj["cache_salt"]
    if not isinstance(salt, str) or not salt or len(salt.encode()) > 1024:
        raise InvalidRequest("'cache_salt' must be a non-empty string of at most 1024 bytes", param="cache_salt")
    if family not in SALTED_FAMILIES:
        raise CacheSaltUnsupported(bound_by)


class _Admitted:
    """``RequestService._admitted``'s context: the admission lease, and the key's count once it is granted.
    A class rather than a generator: it is entered and left once per request on the relay's path."""

    __slots__ = ("_lease", "_keys", "_request_id")

    def __init__(self, lease: Lease, keys: Keyring | None, request_id: str) -> None:
        self._lease, self._keys, self._request_id = lease, keys, request_id

    async def __aenter__(self) -> None:
        await self._lease.__aenter__()
        if self._keys is not None:
            try:
                self._keys.admitted(self._request_id)
            except BaseException as error:
                await self._lease.__aexit__(type(error), error, error.__traceback__)
                raise

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None, trace: Any) -> None:
        await self._lease.__aexit__(kind, error, trace)
