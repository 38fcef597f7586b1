"""The post-wake canary: one fixed request, greedy and short, whose answer a woken engine must repeat.

Sent straight to the engine (not through admission) at a launch's first
readiness, and again after every wake, for deployments whose residency
parks (host_backed, deep). The controller keeps the first answer and
compares; a different answer after a wake means the weights did not come
back as they were, and the instance is stopped.
"""

from __future__ import annotations

from typing import Any

import anyio
import msgspec

from capyctl.domain.errors import EdgeError
from capyctl.domain.lifecycle import EngineAddress
from capyctl.domain.ports import EngineSession
from capyctl.domain.streams import Chunks, Done, Relayed, StreamEvent
from capyctl.services.chat import failure_error

_decode = msgspec.json.Decoder(dict[str, Any]).decode
REQUEST: dict[str, Any] = {
    "messages": [{"role": "user", "content": "Answer with one word: are you ready?"}],
    "max_tokens": 8,
    "temperature": 0,
    "stream": True,
}


class Canary:
    def __init__(self, session: EngineSession) -> None:
        self._session = session

    async def __call__(self, address: EngineAddress, served_model: str) -> str:
        """The engine's answer to the canary, its text only."""
        body = msgspec.json.encode({**REQUEST, "model": served_model})
        text: list[str] = []

        def deliver(batch: list[StreamEvent]) -> Relayed:
            for event in batch:
                if type(event) is Chunks:
                    for payload in event.payload_list():
                        obj = _decode(payload)
                        if "error" in obj and "choices" not in obj:
                            error = obj["error"]
                            raise failure_error(error if isinstance(error, dict) else {"message": str(error)})
                        for choice in obj.get("choices") or ():
                            content = (choice.get("delta") or {}).get("content")
                            if isinstance(content, str):
                                text.append(content)
                elif type(event) is Done:
                    return Relayed.ENDED
            return Relayed.MORE

        async with self._session.chat_stream(address, body) as answer:
            if await answer.pump(deliver, anyio.lowlevel.checkpoint):
                return "".join(text)
        raise EdgeError("the engine's answer to the canary ended without [DONE]")
