"""Starting and stopping the child processes a parent owns.

Used by the worker for its slots, by ``trainjobs serve --api-processes N`` for its API processes and by
``trainjobs dev`` for the API and the worker. Each child runs in a session of its own (so a terminal's
Ctrl-C reaches only the parent, which stops children in order) and dies with its parent: a parent
killed by any signal, SIGKILL included, leaves nothing listening or consuming behind. Stopping is
SIGTERM to all at once, then SIGKILL to the group of whatever outlives the timeout. A parent stops on
any of :data:`STOP_SIGNALS`, whatever dispositions it inherited.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import IO, Protocol

from worker.service_parent import forked

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
# Ctrl-C, SIGTERM (docker stop, systemd, a test) and SIGHUP (its terminal closed) all stop a parent.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
SignalHandler = Callable[[int, FrameType | None], object] | int | None


# The stop signals :func:`interrupt` took since :func:`on_stop_signals` installed it. Python runs a
# signal's handler at its next bytecode, which may be inside code whose exceptions it only reports
# ("Exception ignored in ..."): an at-fork hook (logging's, run by every spawn_child), a finalizer. A
# KeyboardInterrupt raised there is lost; the record is not (:func:`wait_children` reads it).
_interrupted: list[int] = []


def interrupt(signum: int, _frame: FrameType | None) -> None:
    """A stop-signal handler that stops like Ctrl-C, whichever stop signal came: KeyboardInterrupt."""
    _interrupted.append(signum)
    raise KeyboardInterrupt


def interrupted() -> bool:
    """Whether :func:`interrupt` took a stop signal, even one whose KeyboardInterrupt was lost."""
    return bool(_interrupted)


class ChildProcess(Protocol):
    """What a parent needs of a child: ``subprocess.Popen`` and worker.service_parent's ForkedProcess both."""

    @property
    def pid(self) -> int: ...
    @property
    def returncode(self) -> int | None: ...
    def poll(self) -> int | None: ...
    def wait(self, timeout: float | None = None) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


def wait_children(children: Sequence[ChildProcess], poll_s: float = 0.5) -> None:
    """Wait until one of ``children`` exits; KeyboardInterrupt when a stop signal came, also one whose
    own KeyboardInterrupt was lost."""
    while all(child.poll() is None for child in children):
        if interrupted():
            raise KeyboardInterrupt
        time.sleep(poll_s)


def on_stop_signals(handler: Callable[[int, FrameType | None], object] = interrupt) -> dict[int, SignalHandler]:
    """Install ``handler`` for every one of :data:`STOP_SIGNALS`; returns the handlers it replaced.

    Whatever this process inherited: a non-interactive shell starts a background job (``trainjobs dev &``)
    with SIGINT ignored, and Python then installs no SIGINT handler of its own, so without this a
    ``kill -INT`` (or a test's Ctrl-C) would be ignored for good.
    """
    _interrupted.clear()
    return {sig: signal.signal(sig, handler) for sig in STOP_SIGNALS}


def die_with_parent(parent_pid: int | None = None) -> None:
    """Ask Linux to SIGTERM this process when its parent dies (``prctl(PR_SET_PDEATHSIG)``).

    A child in a session of its own gets no signal from its parent's group, so without this a
    SIGKILLed parent leaves its children running. ``parent_pid``, when given, closes the race of a
    parent that died before the call: then the process terminates itself at once.
    """
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: the parent's own shutdown still stops children
        return
    if parent_pid is not None and os.getppid() != parent_pid:
        os.kill(os.getpid(), signal.SIGTERM)


def _dies_with(parent_pid: int) -> Callable[[], None]:
    # Runs in the child between fork and exec; the death signal survives exec.
    return lambda: die_with_parent(parent_pid)


def spawn_child(command: Sequence[str], env: Mapping[str, str] | None = None) -> ChildProcess:
    """Start ``command`` in a session of its own, to be SIGTERMed when this process dies.

    The death signal follows the thread that forks, so call this from the parent's main thread. Where
    the environment names a service parent (a testing aid: worker/service_parent.py), it forks the
    process instead, already imported.
    """
    child = forked(command, os.environ if env is None else env, die_with_parent=True)
    if child is not None:
        return child
    return subprocess.Popen(list(command), env=env, start_new_session=True, preexec_fn=_dies_with(os.getpid()))


def start_detached(
    command: Sequence[str], env: Mapping[str, str], log: IO[bytes], cwd: str | None = None
) -> ChildProcess:
    """Start ``command`` in a session of its own, its stdout and stderr to ``log``, to outlive this process
    (a test's or a bench's service): forked by a service parent where the environment names one (a
    testing aid: worker/service_parent.py), else a new interpreter."""
    child = forked(command, env, cwd=cwd, stdout=log.fileno(), stderr=log.fileno())
    if child is not None:
        return child
    return subprocess.Popen(list(command), env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip


def stop_processes(procs: Sequence[ChildProcess], timeout_s: float, what: str) -> None:
    """SIGTERM every process in ``procs``, wait up to ``timeout_s`` in all, then kill the rest's groups."""
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("%s %d did not stop in %.0fs: killing it", what, proc.pid, timeout_s)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
