"""A decision request's way through CapyCTL (DEC-1 … DEC-4): check, resolve, wait, ask the engine once.

A decision is never streamed, and the engine has nothing to show before its
whole answer, so a cut decision is counted by the ``engine_stop`` rule until
the engine's next stop or restart (CAN-2). It waits, starts or wakes its
model through the same admission and controller as chat.
"""

from __future__ import annotations

from typing import Any

import msgspec

from capyctl.domain.decisions import decision_metrics, read_decision, refuse_dropped
from capyctl.domain.engines import EngineFamily
from capyctl.domain.errors import (
    CacheSaltUnsupported,
    EdgeError,
    EngineError,
    EngineRejected,
    EngineUnavailable,
    InvalidJson,
)
from capyctl.domain.requests import Phase
from capyctl.services.requests import Call, RequestService

_encode = msgspec.json.encode
# Engines whose decision route keeps prompt caches apart by cache_salt: vLLM's takes the field; SGLang's
# ignores fields it does not know, so a salted key's decisions there would not be isolated.
DECISION_SALTED = frozenset({EngineFamily.VLLM})
_decode = msgspec.json.Decoder(dict[str, Any]).decode


class DecisionService(RequestService):
    def target(self, obj: dict[str, Any]) -> tuple[str, bool]:
        """The model named, and False: a decision is never streamed."""
        return read_decision(obj), False

    async def decide(self, call: Call) -> dict[str, Any]:
        """The engine's answer to the decision ``call``, with ``capyctl.metrics``."""
        controller = self._pick(call, "decisions")
        engine, obj = controller.engine, call.obj
        refuse_dropped(obj, engine.family, engine.version)  # before anything starts or wakes
        if "cache_salt" in obj and engine.family not in DECISION_SALTED:  # only a salted key adds it
            raise CacheSaltUnsupported(call.key)
        try:
            body = _encode({**obj, "model": controller.spec.served_model})
        except RecursionError as exc:
            raise InvalidJson("JSON nested too deeply (CapyCTL relays up to several hundred levels)") from exc
        self.live[call.id] = call
        try:
            call.phase = Phase.WAITING
            async with self._admission.admit(controller, call, call.wait):
                self._counted(call)
                controller = self._pick(call, "decisions")  # granted: whichever instance serves best now
                while True:  # once, unless the decision reached no engine and may go to another instance
                    controller, route = await self._routed(call, "decisions", controller)
                    self._selected(call, at := controller)
                    sent_at = self._clock.monotonic()
                    try:
                        raw = await self._session.decide(route.address, body)
                        break
                    except EngineError as exc:
                        raise EngineRejected(exc.status, exc.message) from exc
                    except EngineUnavailable as exc:
                        if (nxt := self._fail_over(call, "decisions", exc.unsent)) is not None:
                            controller = nxt  # nothing reached an engine: the next instance
                            continue
                        gone = await controller.lost(route, self._settings.crash_notice, exc)
                        if gone is not None:
                            raise self._of_instance(gone, controller) from exc
                        raise
                    finally:
                        self._left(at)
                done = self._clock.monotonic()
        finally:
            del self.live[call.id]
        try:
            answer = _decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise EdgeError(f"the engine's decision answer is not a JSON object: {raw[:200]!r}") from exc
        answer["model"] = call.deployment
        since = call.received_at
        answer["capyctl"] = {"metrics": decision_metrics(answer, (done - since) * 1000, (done - sent_at) * 1000)}
        return answer
