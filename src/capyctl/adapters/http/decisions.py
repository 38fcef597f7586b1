"""``POST /v1/systemone``, behind the same front door as chat: one JSON answer, never a stream."""

from __future__ import annotations

from typing import Any

from capyctl.adapters.http.errors import error_body, status_of
from capyctl.adapters.http.front import Request, send_one_answer
from capyctl.domain.errors import CapyError
from capyctl.services.decisions import DecisionService

DECISIONS_PATH = "/v1/systemone"


class DecisionEndpoint:
    path = DECISIONS_PATH

    def __init__(self, service: DecisionService) -> None:
        self.service = service

    def target(self, obj: dict[str, Any]) -> tuple[str, bool]:
        return self.service.target(obj)

    def start(self, request: Request) -> None:
        """Nothing is done for a decision before its task runs."""

    async def answer(self, request: Request) -> None:
        await send_one_answer(self.service.decide(request), request)

    async def late_error(self, error: CapyError, request: Request) -> None:
        await request.exchange.json(status_of(error), error_body(error), request.headers)
