"""``trainjobs serve --api-processes N``: N API processes, each listening on a SO_REUSEPORT socket of its own.

uvicorn's own ``--workers N`` shares one listening socket between its processes, and a connection goes
to whichever process is waiting in accept() when it arrives. Clients keep their connections open, so
that first split lasts: bench_api.py saw one of two processes holding 20 to 31 of its 32 connections,
serving them on one core while the other idled, and the submit p99 doubled. With SO_REUSEPORT every
process listens on its own socket bound to the same address, and Linux spreads new connections over
them by a hash of the address pair (32 connections split 17/15 to 20/12 in practice).

The parent here (:func:`serve_api_processes`) only starts, watches and stops the processes: one that
dies is started again, unless it exited with an error status within :data:`FAST_EXIT_S` of starting
(the port is taken, the configuration is wrong) or died that soon :data:`MAX_QUICK_DEATHS` times in a
row, which stops everything with exit status 1. SIGTERM or SIGINT to the parent stops the children
gracefully (uvicorn finishes the requests in flight); each child runs in its own session, so a Ctrl-C
in a terminal reaches them once, through the parent.
"""

from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
import time
from types import FrameType

from worker.processes import ChildProcess, on_stop_signals, spawn_child, stop_processes

log = logging.getLogger(__name__)

APP = "api.main:create_app"
FAST_EXIT_S = 5.0  # a child that fails sooner than this after its start is not restarted...
MAX_QUICK_DEATHS = 3  # ...nor one killed this many times in a row that soon (a crash loop)
STOP_TIMEOUT_S = 30.0  # after SIGTERM, how long the children get before SIGKILL
WATCH_INTERVAL_S = 0.2


def reuse_port_supported() -> bool:
    # macOS and the BSDs accept SO_REUSEPORT but give every connection to one socket.
    return sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")


def reuse_port_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` with SO_REUSEPORT (not listening yet: uvicorn does that).

    The protocol is given explicitly: accepted sockets inherit it, and asyncio sets TCP_NODELAY only
    on sockets that say IPPROTO_TCP (otherwise each keep-alive request after the first waits ~40 ms
    for a delayed ACK; see :func:`trainjobs.commands.service.tcp_nodelay_listener`).
    """
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)[0]
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def serve_one(host: str, port: int, *, access_log: bool) -> None:
    """One API process on its own SO_REUSEPORT listener (a child of :func:`serve_api_processes`)."""
    import uvicorn

    from service_core.logging import configure_logging

    configure_logging()
    try:
        listener = reuse_port_socket(host, port)
    except OSError as exc:
        log.error("cannot listen on %s:%d: %s", host, port, exc)
        raise SystemExit(1) from None
    config = uvicorn.Config(APP, factory=True, log_config=None, proxy_headers=True, access_log=access_log)
    uvicorn.Server(config).run(sockets=[listener])


def child_command(host: str, port: int, *, access_log: bool) -> list[str]:
    command = [sys.executable, "-m", "trainjobs.serving", "--host", host, "--port", str(port)]
    return command if access_log else [*command, "--no-access-log"]


def serve_api_processes(host: str, port: int, processes: int, *, access_log: bool = True) -> int:
    """Keep ``processes`` API processes serving ``host:port`` until SIGTERM or SIGINT; the exit status."""
    if port == 0:
        raise ValueError("--port 0 with several API processes would give each its own port: name one")
    stop_signal: list[int] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop_signal.append(signum)

    previous = on_stop_signals(on_signal)
    command = child_command(host, port, access_log=access_log)

    def start() -> tuple[ChildProcess, float]:
        return spawn_child(command), time.monotonic()

    status = 0
    children = [start() for _ in range(processes)]
    quick_deaths = [0] * processes  # deaths in a row within FAST_EXIT_S of starting, per child
    log.info("serving on %s:%d with %d processes (SO_REUSEPORT)", host, port, processes)
    try:
        while not stop_signal and status == 0:
            time.sleep(WATCH_INTERVAL_S)
            for i, (child, started) in enumerate(children):
                code = child.poll()
                if code is None or stop_signal:
                    continue
                quick = time.monotonic() - started < FAST_EXIT_S
                quick_deaths[i] = quick_deaths[i] + 1 if quick else 0
                # An error status right after starting (port taken, bad configuration) will repeat;
                # so will anything that kills a fresh process again and again.
                if (quick and code > 0) or quick_deaths[i] >= MAX_QUICK_DEATHS:
                    log.error("API process %d exited with %s right after starting; stopping", child.pid, code)
                    status = 1
                    break
                log.warning("API process %d exited with %s; starting another", child.pid, code)
                children[i] = start()
    finally:
        stop_processes([child for child, _ in children], STOP_TIMEOUT_S, "API process")
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    return status


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="One API process of `trainjobs serve --api-processes N`.")
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--no-access-log", dest="access_log", action="store_false")
    args = parser.parse_args(argv)
    serve_one(args.host, args.port, access_log=args.access_log)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
