"""``trainjobs serve --api-processes N``: one SO_REUSEPORT listener per API process (trainjobs.serving)."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import IO

import httpx
import pytest

from service_core.migrations import apply_migrations
from tests.trainjobs.live import REPO, trainjobs_argv
from tests.trainjobs.sockets import accepted_nodelay
from tests.worker.live import free_port
from trainjobs.serving import FAST_EXIT_S, MAX_QUICK_DEATHS, reuse_port_socket, serve_api_processes
from worker.procfs import children_of, is_alive
from worker.service_parent import PARENT_ENV as SERVICE_PARENT_ENV

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SO_REUSEPORT balancing is Linux's")


def serve_env(home: Path, own_children: bool = False) -> dict[str, str]:
    """The environment of a ``trainjobs serve`` on ``home``, whose database is migrated first (serve
    refuses one that is not). ``own_children``: its API processes are its own children, not forked by
    the suite's service parent (worker/service_parent.py), whose keepers would be their parents."""
    apply_migrations(f"sqlite:///{home / 'trainjobs.db'}")
    dropped = {"DATABASE_URL", "BROKER_URL", "TRAINJOBS_ENV"} | ({SERVICE_PARENT_ENV} if own_children else set())
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    return {**env, "TRAINJOBS_HOME": str(home), "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def start_serve(
    tmp_path: Path, port: int, *extra: str, output: IO[bytes] | None = None, own_children: bool = False
) -> subprocess.Popen[bytes]:
    """``trainjobs serve --api-processes 2`` on ``port``, in a session of its own; output to ``output`` or nowhere."""
    return subprocess.Popen(
        trainjobs_argv(["serve", "--host", "127.0.0.1", "--port", str(port), "--api-processes", "2", *extra]),
        env=serve_env(tmp_path, own_children), cwd=REPO, stdout=output or subprocess.DEVNULL, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip


def socket_owners(port: int, state: str) -> list[int]:
    """Pids of the processes holding TCP sockets on local ``port`` in ``state`` (``ss``, iproute2)."""
    out = subprocess.run(
        ["ss", "-tnpH", "state", state, f"( sport = :{port} )"], capture_output=True, text=True, check=True
    ).stdout
    return [int(pid) for pid in re.findall(r"pid=(\d+)", out)]


def age_s(pid: int) -> float:
    """Seconds since ``pid`` started (its start time in /proc, in clock ticks since boot)."""
    started = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    return float(Path("/proc/uptime").read_text().split()[0]) - started


def wait_until(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def test_each_process_listens_on_its_own_socket_and_connections_spread(tmp_path: Path) -> None:
    port = free_port()
    log = (tmp_path / "serve.log").open("wb")
    parent = start_serve(tmp_path, port, "--no-access-log", output=log)
    try:
        wait_until(lambda: len(set(socket_owners(port, "listening"))) == 2, 90, "two listeners")
        listeners = set(socket_owners(port, "listening"))
        assert parent.pid not in listeners  # the parent only starts and watches them

        def all_healthy() -> bool:
            try:
                answers = [httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2) for _ in range(4)]
                return all(a.status_code == 200 for a in answers)
            except httpx.TransportError:
                return False

        wait_until(all_healthy, 60, "both processes to answer")
        # 24 keep-alive connections: the kernel hashes them over both listeners (all on one: 2^-23).
        clients = [httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) for _ in range(24)]
        try:
            assert all(c.get("/healthz").status_code == 200 for c in clients)
            served_by = Counter(socket_owners(port, "established"))
            assert set(served_by) == listeners and sum(served_by.values()) == 24, served_by
        finally:
            for client in clients:
                client.close()

        # A process that dies is replaced; the service keeps answering meanwhile.
        victim = min(listeners)
        os.kill(victim, signal.SIGKILL)
        wait_until(
            lambda: len(set(socket_owners(port, "listening")) - {victim}) == 2, 90, "a replacement listener"
        )
        assert httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5).status_code == 200
        children = set(socket_owners(port, "listening"))
    finally:
        parent.send_signal(signal.SIGTERM)
        status = parent.wait(timeout=60)
        log.close()
    assert status == 0, (tmp_path / "serve.log").read_text()
    # SIGTERM to the parent stopped every API process with it.
    wait_until(lambda: not socket_owners(port, "listening"), 10, "the listeners to close")
    for pid in children:
        assert not is_alive(pid)


def test_api_processes_die_with_a_killed_parent(tmp_path: Path) -> None:
    port = free_port()
    parent = start_serve(tmp_path, port)
    try:
        wait_until(lambda: len(set(socket_owners(port, "listening"))) == 2, 90, "two listeners")
    finally:
        parent.kill()
        parent.wait()
    wait_until(lambda: not socket_owners(port, "listening"), 30, "the orphaned listeners to close")


def test_a_crash_loop_stops_serve_with_status_1(tmp_path: Path) -> None:
    port = free_port()
    parent = start_serve(tmp_path, port, own_children=True)  # found below as serve's children
    try:
        wait_until(lambda: len(set(socket_owners(port, "listening"))) == 2, 90, "two listeners")
        # The first process has run since serve started: its death counts as quick only when it
        # listened within FAST_EXIT_S, which a slow machine does not. It is killed once it is past
        # that, so it never counts; then each replacement, as soon as it is serve's child.
        victim = min(children_of(parent.pid))
        wait_until(lambda: age_s(victim) > FAST_EXIT_S + 1, FAST_EXIT_S + 3, "the first process to be past FAST_EXIT_S")
        seen = children_of(parent.pid)
        os.kill(victim, signal.SIGKILL)
        for _ in range(MAX_QUICK_DEATHS):
            wait_until(lambda: children_of(parent.pid) - seen, FAST_EXIT_S, "a replacement")
            (victim,) = children_of(parent.pid) - seen
            seen.add(victim)
            os.kill(victim, signal.SIGKILL)  # within FAST_EXIT_S of its start
        assert parent.wait(timeout=60) == 1
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
    wait_until(lambda: not socket_owners(port, "listening"), 30, "the listeners to close")


def test_a_taken_port_stops_serve_with_status_1(tmp_path: Path) -> None:
    with socket.socket() as taken:  # a listener without SO_REUSEPORT: the children cannot bind
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        result = subprocess.run(  # --workers: the deprecated name of --api-processes still works
            trainjobs_argv(["serve", "--host", "127.0.0.1", "--port", str(port), "--workers", "2"]),
            env=serve_env(tmp_path), cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert result.returncode == 1, result.stderr[-2000:]
    assert "Address already in use" in result.stderr and "Traceback" not in result.stderr
    assert time.monotonic() - started < 90


def test_several_api_processes_need_a_named_port() -> None:
    with pytest.raises(ValueError, match="--port 0"):
        serve_api_processes("127.0.0.1", 0, 2)


def test_reuse_port_listener_gives_connections_tcp_nodelay() -> None:
    listener = reuse_port_socket("127.0.0.1", 0)
    assert listener.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 1
    assert accepted_nodelay(listener) != 0, "accepted connection lacks TCP_NODELAY"
