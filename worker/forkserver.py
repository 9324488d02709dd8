"""A slot's warm start for runs: fork them from a pre-imported parent instead of a fresh interpreter.

:class:`ForkServer` starts ``python -m worker.zygote`` (see there) when the slot starts, with the
run environment (worker/run_env.py), so the imports that cost a fresh run most of its first ten
seconds happen while the slot waits for work. :meth:`ForkServer.launch` then starts a run as a
:class:`ForkedRun`, which the supervisor drives like a ``subprocess.Popen``: ``pid`` (the leader of
the run's own process group), ``stdout``, ``poll``, ``wait`` and ``send_signal``.

A run still gets a clean process: its own session and group, only the run environment, its own
stdin/stdout/stderr; nothing of the slot (database connections, threads, secrets) is in the parent
it forks from. Whenever the warm path cannot be used, :func:`start_run` starts the run as before with
``subprocess``: no fork server in this process (``trainjobs train``, a test that asked for none), one
still importing past a bound, one that found itself unsafe to fork from (CUDA initialised while
importing), one that died, or a run environment different from the one it imported with (but for
:data:`RUN_TIME_VARIABLES`). ``TRAINJOBS_PREWARM_RUNS=false`` turns it off.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import IO, Any, Protocol

from worker.procfs import is_alive, proc_stat
from worker.zygote import MARKER

log = logging.getLogger(__name__)

READY_WAIT_S = 120.0  # a cold import on a busy machine; past it the run starts the old way
PARENT_WAIT_S = 5.0  # a parent answers at once: it listens only once it has imported
RUN_MODULE = "trainer_core"  # python -m trainer_core: the engine's CLI (trainer_core/cli.py)


class RunProcess(Protocol):
    """What the supervisor needs of a run process: ``subprocess.Popen`` and :class:`ForkedRun` both."""

    @property
    def pid(self) -> int: ...
    @property
    def stdout(self) -> IO[str] | None: ...
    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...


# Variables read only once a run runs, never while it imports: a run whose environment differs from
# the zygote's in these alone is forked all the same, and has them (its child takes the request's
# environment). A node of a multi-node job names gloo's network interface (worker/gang.py:run_env),
# which torch reads as the process group forms; the OOM testing aid is read as the run starts training
# (trainer_core/oom_fault.py, a name this module cannot import without torch).
RUN_TIME_VARIABLES = frozenset({"GLOO_SOCKET_IFNAME", "TRAINJOBS_FAULT_OOM_ABOVE_MICROBATCH"})


class ZygoteProcess(Protocol):
    """What a fork server needs of its zygote's process: ``subprocess.Popen`` and :class:`HandedZygote`."""

    @property
    def pid(self) -> int: ...
    def poll(self) -> int | None: ...
    def kill(self) -> None: ...
    def wait(self, timeout: float | None = None) -> int: ...


class HandedZygote:
    """A zygote forked for this slot by a parent (``TRAINJOBS_ZYGOTE_PARENT``): not this process's
    child, so known by its pid and start time (its parent reaps it, and the pid may then be reused);
    its exit status is its parent's to read."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        stat = proc_stat(pid)
        self.started = stat.started if stat is not None else None

    def poll(self) -> int | None:
        stat = proc_stat(self.pid)
        alive = stat is not None and stat.alive and stat.started == self.started
        return None if alive else -signal.SIGKILL  # gone, status unknown

    def kill(self) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(["worker.zygote"], timeout or 0)
            time.sleep(0.01)
        return code


def zygote_from_parent(path: str, env: Mapping[str, str]) -> tuple[socket.socket, HandedZygote] | None:
    """Ask the parent listening at ``path`` (worker/zygote.py:serve_slots) to fork a zygote for this
    slot; its socket and process, or None when there is no parent or it refuses (the slot then
    starts its own)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.settimeout(PARENT_WAIT_S)
        sock.connect(path)
        sock.send(json.dumps({"executable": sys.executable, "cwd": os.getcwd(), "env": dict(env)}).encode())
        answer = json.loads(sock.recv(65536) or b"{}")
        if not answer.get("ready"):
            raise OSError(answer.get("why") or "the parent closed the connection")
        sock.settimeout(None)
        return sock, HandedZygote(int(answer["pid"]))
    except (OSError, ValueError) as exc:
        sock.close()
        log.info("no zygote from the parent at %s (%s); this slot imports its own", path, exc)
        return None


class ForkServer:
    """One slot's zygote: started once, asked for runs one at a time, stopped with the slot.

    With ``parent`` (the path of a ``worker.zygote --parent``, a testing aid), the zygote is asked
    of that parent first: forked there, it has imported everything already."""

    def __init__(self, env: Mapping[str, str], parent: str | None = None) -> None:
        self.env = dict(env)
        self.lock = threading.Lock()
        self.exits: dict[int, int] = {}
        self.ready: bool | None = None  # None: still importing
        self.dead = False
        self.proc: ZygoteProcess
        handed = zygote_from_parent(parent, self.env) if parent else None
        if handed is not None:
            self.sock, self.proc = handed
            self.ready = True
            return
        ours, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        cmd = [sys.executable, "-m", "worker.zygote", str(child.fileno()), MARKER]
        self.proc = subprocess.Popen(cmd, env=self.env, pass_fds=[child.fileno()], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
        child.close()

    def differences(self, env: Mapping[str, str]) -> set[str]:
        """The variables ``env`` sets otherwise than the zygote's environment, :data:`RUN_TIME_VARIABLES` aside."""
        differs = {name for name in env.keys() | self.env.keys() if env.get(name) != self.env.get(name)}
        return differs - RUN_TIME_VARIABLES

    def usable(self, env: Mapping[str, str]) -> bool:
        """Wait for the imports (up to :data:`READY_WAIT_S`); may a run with ``env`` be forked here?"""
        if self.differences(env):  # the zygote imported under another environment: it would leak
            return False
        deadline = time.monotonic() + READY_WAIT_S
        with self.lock:
            if self.proc.poll() is not None:  # killed while idle: no message would say so before a launch
                self._died()
            while self.ready is None and not self.dead and time.monotonic() < deadline:
                self._read(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
            return bool(self.ready) and not self.dead

    def launch(self, args: Sequence[str], env: Mapping[str, str], stderr: int) -> ForkedRun:
        """Fork a run of ``python -m trainer_core ARGS``; its stdout is a pipe to us."""
        read_end, write_end = os.pipe()
        request = {"args": list(args), "env": dict(env), "cwd": os.getcwd()}
        try:
            with open(os.devnull, "rb") as devnull, self.lock:
                socket.send_fds(self.sock, [json.dumps(request).encode()], [devnull.fileno(), write_end, stderr])
                pid = None
                while pid is None:
                    message = self._read(timeout=30.0)
                    if message is None:
                        raise OSError("the fork server did not answer")
                    pid = message.get("pid")
        except BaseException:
            os.close(read_end)
            raise
        finally:
            os.close(write_end)
        return ForkedRun(self, int(pid), os.fdopen(read_end, "r", encoding="utf-8", buffering=1))

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        """``pid``'s exit status once known, waiting up to ``timeout`` (None: for ever), else None."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            while True:
                if not self.dead:
                    self._drain()
                if pid not in self.exits and self.dead:
                    self._orphan_status(pid)
                if pid in self.exits:
                    return self.exits[pid]
                left = 0.2 if deadline is None else deadline - time.monotonic()
                if left <= 0:
                    return None
                if self.dead:
                    time.sleep(min(0.1, left))
                else:
                    self._read(timeout=min(0.2, left))

    def _drain(self) -> None:
        # Whatever the zygote has sent already, without waiting.
        while not self.dead and self._read(timeout=0) is not None:
            pass

    def _orphan_status(self, pid: int) -> None:
        # The zygote died before reporting: its orphaned child is init's to reap. Alive: no status yet;
        # gone: its status is lost, and a run that vanished is treated as killed.
        if not is_alive(pid):  # a zombie waits for a reaper that is not us: it is gone too
            self.exits[pid] = -signal.SIGKILL

    def _read(self, timeout: float) -> dict[str, Any] | None:
        """One message from the zygote (recording readiness and exits), or None after ``timeout``."""
        if self.dead:
            return None
        readable, _, _ = select.select([self.sock], [], [], timeout)
        if not readable:
            return None
        try:
            data = self.sock.recv(65536)
        except OSError:
            data = b""
        if not data:
            self._died()
            return None
        message: dict[str, Any] = json.loads(data)
        if "ready" in message:
            self.ready = bool(message["ready"])
            if not self.ready:
                log.warning("runs start without pre-imports: %s", message.get("why"))
        if "exit" in message:
            self.exits[int(message["exit"])] = int(message["code"])
        return message

    def _died(self) -> None:
        if not self.dead:
            self.dead = True
            if self.ready is not False:
                log.warning("the runs' fork server ended (status %s); runs start the slow way", self.proc.poll())

    def close(self) -> None:
        # Killed, not waited for: the zygote holds nothing to save (the runs it forked lead sessions of
        # their own and live on), and one still importing would see its socket closed only once its
        # imports end, seconds into the slot's stop (a slot stopped soon after its start).
        self.sock.close()
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


class ForkedRun:
    """A run forked by the zygote, driven like a ``subprocess.Popen`` (only what the supervisor uses)."""

    def __init__(self, server: ForkServer, pid: int, stdout: IO[str]) -> None:
        self.server, self.pid, self.stdout = server, pid, stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired([RUN_MODULE], timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)


_server: ForkServer | None = None


def start_fork_server(env: Mapping[str, str], parent: str | None = None) -> ForkServer:
    """Start this process's fork server (a worker slot calls it once, at start)."""
    global _server
    if _server is None:
        _server = ForkServer(env, parent)
    return _server


def fork_server_pid() -> int | None:
    """The pid of this process's fork server (the parent of the runs it forked), if there is one."""
    return _server.proc.pid if _server is not None else None


def stop_fork_server() -> None:
    global _server
    if _server is not None:
        _server.close()
        _server = None


def start_run(args: Sequence[str], env: Mapping[str, str], stderr: IO[bytes]) -> RunProcess:
    """Start ``python -m trainer_core ARGS``: forked from this process's warm parent when there is a
    usable one, else a fresh interpreter. Either way in a session of its own, stdout a text pipe."""
    server = _server
    if server is not None and server.usable(env):
        try:
            return server.launch(args, env, stderr.fileno())
        except OSError as exc:
            log.warning("forking the run failed (%s); starting it the slow way", exc)
    command = [sys.executable, "-m", RUN_MODULE, *args]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, stdin=subprocess.DEVNULL, text=True,
                            bufsize=1, env=dict(env), start_new_session=True)  # fmt: skip
