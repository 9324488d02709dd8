"""``trainjobs serve --workers N`` hands out connections with TCP_NODELAY (Kludex/uvicorn#3149)."""

from __future__ import annotations

import asyncio
import socket

import uvicorn.config

from trainjobs.commands.service import tcp_nodelay_listener


def test_multi_worker_listener_gives_connections_tcp_nodelay() -> None:
    tcp_nodelay_listener()
    tcp_nodelay_listener()  # idempotent: the second call must not wrap the patched bind again
    config = uvicorn.config.Config(app="api.main:create_app", factory=True, host="127.0.0.1", port=0, workers=2)
    listener = config.bind_socket()
    seen: list[int] = []

    async def serve_one() -> None:
        async def on_connect(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            sock = writer.get_extra_info("socket")
            seen.append(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
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
        assert listener.proto == socket.IPPROTO_TCP
        asyncio.run(serve_one())
    finally:
        listener.close()
    assert seen and seen[0] != 0, "accepted connection lacks TCP_NODELAY"
