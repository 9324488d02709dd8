"""A real uvicorn serving a test's app on a free local port, and a raw-socket client for bodies
that httpx cannot send the way an attacker would (chunked, cut off when the server answers)."""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI


@contextmanager
def serve(app: FastAPI) -> Iterator[str]:
    """``http://127.0.0.1:<port>`` of ``app`` served by uvicorn in a thread, until the block ends."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@dataclass(frozen=True)
class RawAnswer:
    status: int
    head: str
    body: bytes
    sent: int  # body bytes the server let the client send before it answered or hung up


def post_chunked(url: str, path: str, headers: dict[str, str], prefix: bytes, total: int) -> RawAnswer:
    """POST ``prefix`` then zeros up to ``total`` bytes as a chunked body, 1 MiB per chunk.

    Stops sending as soon as the server answers or stops reading, as a client would.
    """
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        lines = [f"POST {path} HTTP/1.1", f"Host: {host}", "Transfer-Encoding: chunked"]
        lines += [f"{k}: {v}" for k, v in headers.items()]
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        sent, chunk = 0, prefix + bytes((1 << 20) - len(prefix))
        sock.settimeout(2)
        while sent < total:
            if select.select([sock], [], [], 0)[0]:
                break  # the server has answered (or closed)
            try:
                sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                break
            sent, chunk = sent + len(chunk), bytes(1 << 20)
        else:
            sock.sendall(b"0\r\n\r\n")
        sock.settimeout(10)
        answer = b""
        try:
            while data := sock.recv(65536):
                answer += data
                if b"\r\n\r\n" in answer and _complete(answer):
                    break
        except ConnectionResetError:
            pass
    head, _, body = answer.partition(b"\r\n\r\n")
    return RawAnswer(int(head.split(b" ", 2)[1]), head.decode("latin-1"), body, sent)


def _complete(answer: bytes) -> bool:
    head, _, body = answer.partition(b"\r\n\r\n")
    for line in head.decode("latin-1").lower().splitlines():
        if line.startswith("content-length:"):
            return len(body) >= int(line.split(":", 1)[1])
    return False
