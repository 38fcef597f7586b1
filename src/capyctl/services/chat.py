"""A chat request's way through CapyCTL: resolve, make ready, ask the engine, relay.

CapyCTL always asks the engine for a stream (CHAT-2): a non-streamed request
is assembled here, so it is cancelled exactly like a stream. For a
non-streamed request usage is asked for; a streamed one keeps the client's
``stream_options``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
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
from capyctl.domain.requests import Phase
from capyctl.domain.streams import Assembler, payloads_of
from capyctl.services.requests import Call, RequestService

_encode = msgspec.json.encode
_decode = msgspec.json.Decoder(dict[str, Any]).decode
SALTED_FAMILIES = frozenset({EngineFamily.VLLM, EngineFamily.SGLANG})  # engines that honour cache_salt


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


class ChatService(RequestService):
    def start(self, call: Call) -> None:
        """A request's first steps, done at once as its last byte arrives (no wait, no I/O but one write):
        the deployment resolved and the engine's body made; where nothing has to wait (the model ready, a
        place free), the admission granted and the request written to its engine, when a kept-alive
        connection to it stands idle. Never raises: an error is kept on the call (``call.error``) for
        ``open`` to raise; what was not done here ``open`` does."""
        try:
            controller = self._pick(call, "chat")
            check_cache_salt(call.obj, controller.engine.family, call.key if call.salt_bound else None)
            call.body = engine_body(call.obj, controller.spec.served_model, call.stream)
            route = controller.route_now()
            call.lease = self._admission.admit_now(controller, call) if route is not None else None
            if call.lease is None:
                return
            self._counted(call)
        except CapyError as error:
            call.give_back()
            call.error = error
            return
        except BaseException:
            call.give_back()
            raise
        assert route is not None  # (a lease is granted at once only with a route)
        call.route = route
        call.engine_stream = self._session.chat_stream(route.address, call.body)
        # counted at its instance now, not when ``open`` runs: the next request's pick (a burst's come one
        # after another, before any ``open``) must see it there
        self._selected(call, controller)
        call.counted = controller

    @asynccontextmanager
    async def open(self, call: Call) -> AsyncIterator[Call]:
        """The engine's answer to ``call``, ready to relay (``call.pump``) inside the block, and its metrics
        (``call.metrics()``) after it.

        Raises domain errors before the block runs (unknown model, engine refusal ...). Leaving the block
        closes the engine connection. Does what ``start`` did not (``start`` is run first if it never was).
        """
        if call.controller is None and call.error is None:
            self.start(call)
        if call.error is not None:
            raise call.error
        controller = call.controller
        assert controller is not None
        self.live[call.id] = call
        try:
            lease, counted = self._lease(controller, call)
            if not counted:
                call.phase = Phase.WAITING
            async with lease:
                if not counted:
                    self._counted(call)
                    controller = self._pick(call, "chat")  # granted: whichever instance serves best now
                while True:  # once, unless the request reached no engine and may go to another instance
                    route = call.route
                    if route is None:  # granted: ready, unless it fell
                        controller, route = await self._routed(call, "chat", controller)
                        call.route = route
                    stream, call.engine_stream = call.engine_stream, None
                    at, call.counted = call.counted, None  # counted by ``start`` when it wrote the request
                    if stream is None:  # (the session may write the request at once: the rest is done meanwhile)
                        stream = self._session.chat_stream(route.address, call.body)
                    try:
                        self._arm(call, controller)
                    except BaseException:
                        stream.abandon()
                        if at is not None:
                            self._left(at)
                        raise
                    if at is None:
                        self._selected(call, at := controller)
                    streaming = False
                    try:
                        async with stream as answer:
                            streaming = True
                            call.answer = answer
                            yield call
                        return
                    except EngineUnavailable as exc:
                        if not streaming and (nxt := self._fail_over(call, "chat", exc.unsent)) is not None:
                            controller, call.route = nxt, None  # nothing reached an engine: the next instance
                            continue
                        # stopped, or crashed and restarting
                        gone = await controller.lost(route, self._settings.crash_notice, exc)
                        if gone is not None:
                            raise self._of_instance(gone, controller) from exc
                        if streaming:  # the engine is still there, but its answer broke off
                            raise EdgeError(
                                f"the engine's connection broke before the end of its stream ({exc.message})"
                            ) from exc
                        raise
                    finally:
                        call.answer = None
                        self._left(at)
        finally:
            del self.live[call.id]

    async def complete(self, call: Call) -> dict[str, Any]:
        """A non-streamed answer, assembled from the engine's stream as the relay checked it, with
        ``capyctl.metrics``."""
        parts: list[bytes] = []

        def keep(data: bytes) -> bool:
            parts.append(data)
            return False  # never full: the answer is kept whole

        async with self.open(call):
            parts.append(await call.pump(keep, anyio.lowlevel.checkpoint))
        if call.failure is not None:
            raise failure_error(call.failure)
        assembler = Assembler(call.deployment, self._settings.max_tool_calls)
        for payload in payloads_of(b"".join(parts)):
            try:
                chunk = _decode(payload)
            except (msgspec.DecodeError, RecursionError) as error:  # what the check relays unread (1e999)
                raise EdgeError(f"the engine sent a chunk CapyCTL cannot assemble into an answer: {error}") from error
            assembler.add(chunk)
        answer = assembler.result()
        answer["capyctl"] = {"metrics": call.metrics()}
        return answer


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
