"""The post-wake canary: one fixed request, greedy and short, whose answer a woken engine must repeat.

Sent straight to the engine (not through admission) at a launch's first
readiness, and again after every wake, for deployments whose residency
parks (host_backed, deep). The controller keeps the first answer and
compares; a different answer after a wake means the weights did not come
back as they were, and the instance is stopped.
"""

from __future__ import annotations

from typing import Any

import msgspec

from capyctl.domain.errors import EdgeError
from capyctl.domain.ports import EngineSession
from capyctl.domain.streams import Chunk, Done, EngineFailure
from capyctl.services.chat import failure_error

REQUEST: dict[str, Any] = {
    "messages": [{"role": "user", "content": "Answer with one word: are you ready?"}],
    "max_tokens": 8,
    "temperature": 0,
    "stream": True,
}


class Canary:
    def __init__(self, session: EngineSession) -> None:
        self._session = session

    async def __call__(self, base_url: str, served_model: str) -> str:
        """The engine's answer to the canary, its text only."""
        body = msgspec.json.encode({**REQUEST, "model": served_model})
        text: list[str] = []
        async with self._session.chat_stream(base_url, body) as events:
            async for batch in events:
                for event in batch:
                    if isinstance(event, Chunk):
                        for choice in event.obj.get("choices") or ():
                            content = (choice.get("delta") or {}).get("content")
                            if isinstance(content, str):
                                text.append(content)
                    elif isinstance(event, EngineFailure):
                        raise failure_error(event.error)
                    elif isinstance(event, Done):
                        return "".join(text)
        raise EdgeError("the engine's answer to the canary ended without [DONE]")
