"""``POST /v1/systemone``, behind the same front door as chat: one JSON answer, never a stream."""

from __future__ import annotations

from typing import Any

import msgspec

from capyctl.adapters.http.asgi import send_json
from capyctl.adapters.http.chat import Headers, Outcome
from capyctl.adapters.http.errors import error_body, retry_after, status_of
from capyctl.domain.errors import CapyError
from capyctl.domain.requests import Phase, RequestRecord
from capyctl.services.decisions import DecisionService

DECISIONS_PATH = "/v1/systemone"
_encode = msgspec.json.encode


class DecisionEndpoint:
    path = DECISIONS_PATH

    def __init__(self, service: DecisionService) -> None:
        self.service = service

    def target(self, obj: dict[str, Any]) -> tuple[str, bool]:
        return self.service.target(obj)

    async def answer(self, record: RequestRecord, obj: dict[str, Any], wait: float | None, send: Any,
                     headers: Headers, outcome: Outcome, received_at: float) -> None:
        try:
            answer = await self.service.decide(record, obj, received_at, wait)
        except CapyError as error:
            record.phase = Phase.FAILED
            outcome.code = error.code
            await send_json(send, status_of(error), error_body(error), headers + retry_after(error))
            return
        record.phase = Phase.DONE
        outcome.code = "ok"
        await send_json(send, 200, _encode(answer), headers)

    async def late_error(self, error: CapyError, send: Any, headers: Headers, outcome: Outcome) -> None:
        await send_json(send, status_of(error), error_body(error), headers)
