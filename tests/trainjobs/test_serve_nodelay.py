"""uvicorn's own `--workers N` listener (`trainjobs serve` off Linux) hands out connections with TCP_NODELAY
(Kludex/uvicorn#3149)."""

from __future__ import annotations

import socket

import uvicorn.config

from tests.trainjobs.sockets import accepted_nodelay
from trainjobs.commands.service import tcp_nodelay_listener


def test_multi_worker_listener_gives_connections_tcp_nodelay() -> None:
    tcp_nodelay_listener()
    tcp_nodelay_listener()  # idempotent: the second call must not wrap the patched bind again
    config = uvicorn.config.Config(app="api.main:create_app", factory=True, host="127.0.0.1", port=0, workers=2)
    listener = config.bind_socket()
    assert listener.proto == socket.IPPROTO_TCP
    assert accepted_nodelay(listener) != 0, "accepted connection lacks TCP_NODELAY"
