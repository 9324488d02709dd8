"""What an asyncio server does with a listener's accepted connections (shared by the serve tests)."""

from __future__ import annotations

import asyncio
import socket


def accepted_nodelay(listener: socket.socket) -> int:
    """TCP_NODELAY (0: off) of one connection that asyncio accepts on ``listener``; closes the listener."""
    seen: list[int] = []

    async def accept_one() -> None:
        async def on_connect(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            seen.append(writer.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(on_connect, sock=listener)
        async with server:
            _reader, writer = await asyncio.open_connection(*listener.getsockname()[:2])
            for _ in range(100):
                if seen:
                    break
                await asyncio.sleep(0.01)
            writer.close()

    try:
        asyncio.run(accept_one())
    finally:
        listener.close()
    assert seen, "no connection was accepted"
    return seen[0]
