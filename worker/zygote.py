"""The pre-imported parent a worker slot forks its runs from: ``python -m worker.zygote FD trainjobs-run``.

A fresh ``python -m trainer_core`` spends most of its first ten seconds importing torch,
transformers, datasets and accelerate (bench/bench_service_overhead.py). This process imports them
once, with the environment a run gets (worker/run_env.py), then waits on its end of a Unix socket
(SOCK_SEQPACKET, inherited as file descriptor ``FD``) for requests from its slot
(:mod:`worker.forkserver`). Each request carries the run's arguments, environment and working
directory, and three file descriptors: stdin, stdout (the slot's pipe) and stderr (the run's log).
For each it forks a child that becomes the run: a session of its own, those descriptors as 0/1/2,
the request's environment, then the engine's ``main`` and ``os._exit`` with its status.

The slot learns ``{"pid": N}`` at once and ``{"exit": N, "code": C}`` (``C`` as
``subprocess.Popen.returncode``: negative for a signal) when the child ends, since only this process
can wait for it. The socket closing (the slot died) ends this process; its children run on, exactly
as a run started with ``subprocess`` outlives a dead slot (recovery kills leftovers by pid file).

Only this module's own imports and trainer_core are loaded: no service code, settings or secrets.
The last argument is a marker only: recovery recognises a run process by ``trainjobs`` in its
command line (worker/recovery.py), and a forked run shows this process's command line.

``python -m worker.zygote --parent PATH trainjobs-run`` is a testing aid (``TRAINJOBS_ZYGOTE_PARENT``):
a zygote that serves no slot itself but listens on a Unix socket at ``PATH`` and forks a zygote for
each slot that connects, which then serves that slot exactly as above. The suite starts about forty
workers on one machine, each of whose slots would otherwise import torch again (:func:`serve_slots`).
It refuses a slot whose own zygote would have imported otherwise (another interpreter, folder or run
environment: :func:`refusal`); a handed zygote joins its slot's namespaces (:func:`enter_namespaces`).
Such a zygote, and its runs, show the parent's command line, which has the marker too.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import importlib.machinery
import json
import os
import select
import signal
import socket
import struct
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

MARKER = "trainjobs-run"  # on this process's (and so every forked run's) command line, for recovery
RUN_MAIN = "trainer_core.cli"  # what ``python -m trainer_core`` runs
# What a run imports before its first step; the rest of trainer_core loads with these.
PREIMPORTS = (
    "trainer_core.cli", "trainer_core.run", "trainer_core.preflight", "trainer_core.failures",
    "trainer_core.backends.trainer_backend", "trainer_core.backends.accelerate_backend",
    "transformers.models.bert.modeling_bert",
)  # fmt: skip
MAX_MESSAGE = 1 << 20  # a request: argv, environment, cwd (the environment is the large part)
REAP_EVERY_S = 0.05
HELLO_WAIT_S = 5.0  # a slot's hello follows its connect at once
# What a zygote forked for a slot joins of the slot's (mount first: the others' files are found in it).
JOINED_NAMESPACES = ("mnt", "net", "uts", "ipc")


def preimport() -> str | None:
    """Import what runs need; returns why this process cannot serve runs, or None."""
    from trainer_core import preimport as imports

    # The collector paused while importing, then everything frozen: forked runs also leave the pages
    # they share with this process alone (no collector bits written into them).
    for name, exc in imports.preimport(PREIMPORTS).items():  # a run that needs it reports the error in its own process
        print(f"worker.zygote: {name} not preimported: {type(exc).__name__}: {exc}", file=sys.stderr)
    return imports.unsafe_to_fork()


def become_run(request: dict[str, Any], fds: list[int], sock: socket.socket) -> None:
    """In the forked child: turn into the run the request describes, and never return."""
    code = 1
    try:
        sock.close()
        os.setsid()  # a group of its own: the slot signals and sweeps the run's whole group
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = ["python -m trainer_core", *request["args"]]
        code = _run_main(sys.argv[1:])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        # What a normal interpreter exit does: atexit handlers (loggers, trackers), flushed streams.
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _run_main(args: list[str]) -> int:
    import importlib

    main: Callable[[list[str]], int] = importlib.import_module(RUN_MAIN).main
    return int(main(args))


def await_own_session(pid: int, timeout_s: float = 5.0) -> None:
    """Until the forked child leads its own session (its first step), or is gone.

    The slot signals the run's whole group (cancel, fencing: worker/lease.py:kill_own_runs) as soon as
    it hears the pid; before the child's ``setsid`` that group is still this server's. ``Popen`` has
    the same guarantee: it returns only after the child's exec, which follows its ``setsid``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if os.getsid(pid) == pid:
                return
        except ProcessLookupError:
            return
        time.sleep(0.0002)


def serve(sock: socket.socket) -> None:
    """Fork a run per request until the slot's end of the socket closes; report each exit."""
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([sock], [], [], REAP_EVERY_S)
        if readable:
            message, fds, _, _ = socket.recv_fds(sock, MAX_MESSAGE, 3)
            if not message:
                return  # the slot is gone
            request = json.loads(message)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                become_run(request, fds, sock)
            for fd in fds:
                os.close(fd)
            children.add(pid)
            await_own_session(pid)
            sock.send(json.dumps({"pid": pid}).encode())
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                sock.send(json.dumps({"exit": pid, "code": os.waitstatus_to_exitcode(status)}).encode())


def refusal(hello: dict[str, Any], peer_pid: int, env: dict[str, str]) -> str | None:
    """Why a zygote forked here would differ from the one the slot that sent ``hello`` would start
    itself (with ``python -m worker.zygote`` in its folder and run environment), or None."""
    if hello.get("executable") != sys.executable:
        return f"another interpreter ({hello.get('executable')})"
    folder = str(hello.get("cwd"))
    if folder != sys.path[0] and (why := imports_otherwise_in(folder)):  # `python -m` puts it first on sys.path
        return f"another folder ({folder}: {why})"
    theirs: dict[str, str] = hello.get("env") or {}
    if theirs != env:  # the names alone: a token's value is nobody's business in a log
        names = sorted(name for name in env.keys() | theirs.keys() if env.get(name) != theirs.get(name))
        return f"another run environment ({', '.join(names)})"
    if namespace(peer_pid, "pid") != namespace(os.getpid(), "pid"):
        return "another pid namespace"  # joined only by children: the zygote itself could not be in it
    return None


def imports_otherwise_in(folder: str) -> str | None:
    """Why a zygote started in ``folder`` (first on its sys.path, where this process has its own) might
    import otherwise than this one, or None: ``folder`` holds modules, which could shadow others, or this
    process took modules from its own folder that the rest of the path would not give (say, a checkout
    that is not installed)."""
    try:
        held = sorted(entry for entry in os.listdir(folder) if _is_module(Path(folder) / entry))
    except OSError as exc:
        return str(exc)
    if held:
        return f"it holds {', '.join(held[:5])}"
    if own := _only_in_own_folder():
        return f"{', '.join(own[:5])} came from {sys.path[0]}"
    return None


def _is_module(entry: Path) -> bool:
    if entry.is_dir():
        return (entry / "__init__.py").is_file()  # a namespace portion shadows nothing that exists elsewhere
    return entry.name.endswith((".py", ".pyc", *importlib.machinery.EXTENSION_SUFFIXES))


@functools.cache
def _only_in_own_folder() -> list[str]:
    # The top-level modules this process imported from its folder that the rest of the import path
    # resolves to another file, or to none.
    names = []
    for name, module in list(sys.modules.items()):
        origin = getattr(getattr(module, "__spec__", None), "origin", None)
        if "." in name or name.startswith("__") or not isinstance(origin, str):
            continue  # submodules follow their package; __main__ and its aliases
        here = importlib.machinery.PathFinder.find_spec(name, sys.path[:1])
        if here is not None and here.origin == origin and _origin(name, sys.path[1:]) != origin:
            names.append(name)
    return sorted(names)


def _origin(name: str, path: list[str]) -> str | None:
    """Where ``import name`` would load from with ``path`` as sys.path, asking the finders in order."""
    for finder in sys.meta_path:
        if finder is importlib.machinery.PathFinder:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
        else:
            find = getattr(finder, "find_spec", None)
            spec = find(name, None) if find is not None else None
        if spec is not None:
            return spec.origin
    return None


def namespace(pid: int, space: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/{space}")
    except OSError:
        return None


def enter_namespaces(peer_pid: int) -> str | None:
    """In a zygote just forked for a slot: join the slot's namespaces where they differ from this
    process's (a fleet test's host: its own network, hostname and mounts; root only), so that the runs
    it forks live where the slot's own zygote would. Why it could not, or None."""
    libc = ctypes.CDLL(None, use_errno=True)
    cwd = os.getcwd()
    for space in JOINED_NAMESPACES:
        theirs = namespace(peer_pid, space)
        if theirs is None:
            return f"the slot's {space} namespace is unreadable"
        if theirs == namespace(os.getpid(), space):
            continue
        fd = os.open(f"/proc/{peer_pid}/ns/{space}", os.O_RDONLY)
        try:
            if libc.setns(fd, 0) != 0:
                return f"cannot join the slot's {space} namespace: {os.strerror(ctypes.get_errno())}"
        finally:
            os.close(fd)
        if namespace(os.getpid(), space) != theirs:
            return f"joined another {space} namespace than the slot's"
    os.chdir(cwd)  # joining a mount namespace moves the working directory to its root
    return None


def serve_slots(listener: socket.socket, env: dict[str, str]) -> None:
    """The ``--parent`` loop: per connection, fork a zygote that serves the slot on it (or refuse)."""
    zygotes: set[int] = set()
    while True:
        readable, _, _ = select.select([listener], [], [], REAP_EVERY_S)
        if readable:
            conn, _ = listener.accept()
            with contextlib.suppress(OSError, ValueError):  # a slot that went away or sent garbage
                _fork_zygote(listener, conn, env, zygotes)
            conn.close()
        for pid in list(zygotes):
            if os.waitpid(pid, os.WNOHANG)[0]:
                zygotes.discard(pid)


def _fork_zygote(listener: socket.socket, conn: socket.socket, env: dict[str, str], zygotes: set[int]) -> None:
    conn.settimeout(HELLO_WAIT_S)
    hello = json.loads(conn.recv(MAX_MESSAGE))
    peer_pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    why = "another user" if uid != os.getuid() else refusal(hello, peer_pid, env)
    if why is not None:
        print(f"worker.zygote: refused pid {peer_pid}: {why}", file=sys.stderr, flush=True)
        conn.send(json.dumps({"ready": False, "why": why}).encode())
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            listener.close()
            conn.settimeout(None)
            os.setsid()  # as a zygote its slot starts: a session of its own, which outlives this parent
            why = enter_namespaces(peer_pid)
            if why is not None:
                print(f"worker.zygote: refused pid {peer_pid}: {why}", file=sys.stderr, flush=True)
            conn.send(json.dumps({"ready": why is None, "why": why, "pid": os.getpid()}).encode())
            if why is None:
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    serve(conn)
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)  # never back into the parent's loop
    zygotes.add(pid)


def listen_at(path: str) -> socket.socket:
    """A parent's listening socket at ``path``, made only once it has imported: who finds no socket there
    (the parent still importing, or gone) starts its own process instead of waiting."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(64)
    return listener


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the slot's to handle
    if args[0] == "--parent":
        env = dict(os.environ)  # before the imports, some of which write to it
        unsafe = preimport()
        if unsafe is not None:
            print(f"worker.zygote: cannot fork zygotes: {unsafe}", file=sys.stderr)
            return 1
        serve_slots(listen_at(args[1]), env)
        return 0
    sock = socket.socket(fileno=int(args[0]))
    unsafe = preimport()
    sock.send(json.dumps({"ready": unsafe is None, "why": unsafe}).encode())
    if unsafe is not None:
        return 1
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the slot went away meanwhile
        serve(sock)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
