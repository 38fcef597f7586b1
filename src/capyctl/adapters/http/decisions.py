"""``POST /v1/systemone``, behind the same front door as chat: one JSON answer, never a stream."""

from __future__ import annotations

from typing import Any

from capyctl.adapters.http.errors import error_body, status_of
from capyctl.adapters.http.exchange import Exchange
from capyctl.adapters.http.front import Headers, Outcome, send_one_answer
from capyctl.domain.errors import CapyError
from capyctl.domain.requests import RequestRecord
from capyctl.services.decisions import DecisionService

DECISIONS_PATH = "/v1/systemone"


class DecisionEndpoint:
    path = DECISIONS_PATH

    def __init__(self, service: DecisionService) -> None:
        self.service = service

    def target(self, obj: dict[str, Any]) -> tuple[str, bool]:
        return self.service.target(obj)

    def start(self, record: RequestRecord, obj: dict[str, Any]) -> None:
        """Nothing is done for a decision before its task runs."""

    async def answer(
        self,
        record: RequestRecord,
        obj: dict[str, Any],
        wait: float | None,
        exchange: Exchange,
        headers: Headers,
        outcome: Outcome,
        received_at: float,
        started: Any = None,
    ) -> None:
        await send_one_answer(self.service.decide(record, obj, received_at, wait), record, exchange, headers, outcome)

    async def late_error(self, error: CapyError, exchange: Exchange, headers: Headers, outcome: Outcome) -> None:
        await exchange.json(status_of(error), error_body(error), headers)
