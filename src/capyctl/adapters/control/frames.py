"""What both ends of the control link do alike: send a message on a link that may be closing, and beat."""

from __future__ import annotations

import contextlib

import anyio
from websockets.asyncio.connection import Connection
from websockets.exceptions import ConnectionClosed

from capyctl.domain.link import Heartbeat, Message, encode


async def send_quietly(conn: Connection, message: Message) -> None:
    """``message`` on ``conn``; nothing when the link is closing (its end is noticed where it is read)."""
    with contextlib.suppress(ConnectionClosed):
        await conn.send(encode(message))


async def beat(conn: Connection, every: float) -> None:
    """A heartbeat every ``every`` s until the link closes."""
    seq = 0
    try:
        while True:
            seq += 1
            await conn.send(encode(Heartbeat(seq=seq, at=anyio.current_time())))
            await anyio.sleep(every)
    except ConnectionClosed:
        return
