"""Engine answers for unit tests: an ``EngineAnswer`` (``domain/ports.py``) that pumps scripted batches of
events, as the wire session pumps the batches of its reads."""

from __future__ import annotations

from collections.abc import AsyncIterable, Awaitable, Callable
from typing import Any

import anyio
import msgspec

from capyctl.domain.lifecycle import EngineAddress
from capyctl.domain.streams import DONE, Chunks, Relayed, StreamEvent


def chunks(*objs: dict[str, Any]) -> Chunks:
    """The chunks ``objs`` as one read's ``Chunks`` event."""
    payloads = [msgspec.json.encode(obj) for obj in objs]
    return Chunks(b"".join(b"data: " + payload + b"\n\n" for payload in payloads), payloads)


class ScriptedAnswer:
    """Pumps the batches ``batches`` yields, honouring FULL (``drain`` awaited) and ENDED like the wire."""

    def __init__(self, batches: AsyncIterable[list[StreamEvent]]) -> None:
        self._batches = batches

    async def pump(self, deliver: Callable[[list[StreamEvent]], Relayed], drain: Callable[[], Awaitable[None]]) -> bool:
        async for batch in self._batches:
            said = deliver(batch)
            if said is Relayed.ENDED:
                return True
            if said is Relayed.FULL:
                await drain()
        return False


def _at_done(batch: list[StreamEvent]) -> bool:
    return batch[-1] is DONE


async def pump_all(
    session: Any, url: str, body: bytes, ended: Callable[[list[StreamEvent]], bool] = _at_done
) -> tuple[list[list[StreamEvent]], bool]:
    """A streamed call through ``session`` (an ``EngineSession``), pumped whole: (each batch the answer came
    in, what pump returned). Delivery says ENDED when ``ended`` (default: at ``[DONE]``), never FULL."""
    batches: list[list[StreamEvent]] = []

    def deliver(batch: list[StreamEvent]) -> Relayed:
        batches.append(batch)
        return Relayed.ENDED if ended(batch) else Relayed.MORE

    async def drain() -> None:
        raise AssertionError("nothing said FULL")

    with anyio.fail_after(10):
        async with session.chat_stream(EngineAddress(url), body) as answer:
            said_ended = await answer.pump(deliver, drain)
    return batches, said_ended
