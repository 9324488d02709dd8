"""A testing aid: start the service's own processes forked from a pre-imported parent.

``python -m worker.service_parent PATH [MODULE ...]`` imports what the API, a worker and its slots import
(FastAPI, SQLAlchemy, Celery, and the estimator's and preflight's torch, transformers and datasets, which
every API process imports at its start: api/main.py's warm-up), and each ``MODULE`` named, then listens on
a Unix socket at ``PATH``.
With ``TRAINJOBS_SERVICE_PARENT=PATH`` in the environment a process starts for another,
:func:`forked` asks that parent for ``python -m MODULE ARGS`` instead of starting an interpreter:
the suite starts about forty services on one machine, each of whose API processes, workers and slots
would otherwise spend seconds of CPU importing the same modules (about 4 s an API process).

A forked process is the one a fresh interpreter would have been, as far as its code can tell: the
command line and environment it was asked for (``/proc/PID/cmdline`` and ``environ`` too, which tests
and sweeps read), a session of its own, the given stdin, stdout and stderr, the requester's ignored
signals, the folder as ``sys.path[0]``, and at its end what an interpreter's exit does (threads
joined, ``atexit``, streams flushed). The parent refuses, and the requester starts the process itself,
whenever that could not hold: another interpreter, a folder that would import otherwise, a variable
that differs from the parent's among those read while importing (all but :func:`varies_freely`'s),
other namespaces (a fleet test's host), another user, or a command that is not ``python -m``.

Between parent and process stands a keeper, forked per request: the process's parent, which reports
its pid and then its exit status to the requester over the connection (the requester cannot wait for
a process that is not its child: :class:`ForkedProcess` is driven like a ``subprocess.Popen``), and
which SIGTERMs it when the requester dies, if asked to (``die_with_parent``: worker/processes.py's
children). That is the one difference a process could see: its parent is the keeper, not the process
that asked for it (a slot knows its worker by the name the worker passes: worker/paths.py:worker_of_slot;
a test that looks for a process's children keeps the variable out of that process's environment).
Nothing here runs unless the variable is set; production never sets it.
"""

from __future__ import annotations

import contextlib
import ctypes
import io
import json
import os
import runpy
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from typing import Any

from worker.procfs import proc_stat
from worker.zygote import imports_otherwise_in, listen_at, namespace

PARENT_ENV = "TRAINJOBS_SERVICE_PARENT"  # the setting (service_core/settings.py): the parent's socket
MAX_MESSAGE = 1 << 20  # a request: argv, environment, cwd
ANSWER_WAIT_S = 30.0  # a keeper answers once its process is set up: two forks and a few system calls
# What the service processes import at their start; our own modules only where importing reads no
# setting (worker.celery_app builds its Celery app from the settings when imported: not it, nor what
# imports it). Modules run as ``-m`` stay out: run_module would find them imported already. The API's and
# the CLI's modules, which this package may not import, the command line names (tests/shared_servers.py).
PREIMPORTS = (
    "fastapi", "starlette", "uvicorn", "uvicorn.config", "uvicorn.server", "pydantic_settings", "sqlalchemy.orm",
    "httpx", "psycopg", "alembic", "alembic.command", "celery", "celery.bin.celery", "celery.apps.worker",
    "kombu", "kombu.transport.sqlalchemy", "redis", "service_core.queue", "trainer_core.memory",
    "trainer_core.preflight", "worker.sweeper", "worker.webhook_sender", "worker.supervisor", "worker.forkserver",
)  # fmt: skip
SETTINGS_READ_AT_IMPORT = "worker.celery_app"
# Variables read only once a process runs, never while the modules above import: a request whose
# environment differs from the parent's in these alone is forked all the same, and has them.
FREE_NAMES = frozenset({
    "DATABASE_URL", "BROKER_URL", "ARTIFACTS_ROOT", "DATA_ROOT", "PYTHONUNBUFFERED", "CUDA_VISIBLE_DEVICES",
    "GLOO_SOCKET_IFNAME", "TRAINJOBS_URL",
    "COLUMNS", "LINES",  # a terminal's size, read when asked (shutil.get_terminal_size); pytest's workers set them
})  # fmt: skip
FREE_PREFIXES = ("TRAINJOBS_", "PYTEST_", "MLFLOW_", "WANDB_", "AWS_")
# The signals whose inherited "ignored" a requester passes on, as a process started by exec keeps it.
PASSED_ON_IGNORED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
PR_SET_MM, PR_SET_MM_MAP = 35, 14
NAMESPACES = ("pid", "mnt", "net", "uts", "ipc")  # a requester's must be this process's


def varies_freely(name: str) -> bool:
    """Whether variable ``name`` may differ between the parent and a process forked from it."""
    return name in FREE_NAMES or name.startswith(FREE_PREFIXES)


def env_differences(theirs: Mapping[str, str], ours: Mapping[str, str]) -> list[str]:
    """The names set otherwise in ``theirs`` than in ``ours`` that a forked process could not take."""
    names = {name for name in theirs.keys() | ours.keys() if theirs.get(name) != ours.get(name)}
    return sorted(name for name in names if not varies_freely(name))


# --- the requester's side ---------------------------------------------------------------------------

# The connections to the keepers of this process's living forked processes. Held here, not only by their
# ForkedProcess: a keeper takes its connection's end for this process's death (``die_with_parent``), so
# it must last as long as this process, as a child's PR_SET_PDEATHSIG does, whatever the caller keeps.
_held: set[socket.socket] = set()


class ForkedProcess:
    """A process forked by the service parent, driven like ``subprocess.Popen`` (what our callers use):
    ``pid`` (the leader of its own session), ``args``, ``returncode``, ``poll``, ``wait``,
    ``send_signal``, ``terminate``, ``kill``. Its exit status comes from its keeper; a keeper gone
    without saying leaves a process that is known gone only by its pid and start time."""

    def __init__(self, sock: socket.socket, pid: int, args: Sequence[str]) -> None:
        self.sock, self.pid, self.args = sock, pid, list(args)
        _held.add(sock)  # open until the exit is known, object or not: its keeper watches it for our end
        self.returncode: int | None = None
        stat = proc_stat(pid)
        self._started = stat.started if stat is not None else None

    def _read(self, timeout: float | None) -> None:
        if self.returncode is not None:
            return
        if self.sock.fileno() >= 0:
            readable, _, _ = select.select([self.sock], [], [], timeout)
            if not readable:
                return
            try:
                data = self.sock.recv(65536)
            except OSError:
                data = b""
            _held.discard(self.sock)
            self.sock.close()
            if data:
                self.returncode = int(json.loads(data)["exit"])
                return
            # The keeper is gone without a word: go by the process itself.
        elif timeout is None or timeout > 0:
            time.sleep(0.05 if timeout is None else min(timeout, 0.05))
        stat = proc_stat(self.pid)
        if stat is None or not stat.alive or stat.started != self._started:
            self.returncode = -signal.SIGKILL  # gone, its status lost with its keeper

    def poll(self) -> int | None:
        self._read(timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout or 0)
            self._read(timeout=left if left is None else min(left, 1.0))
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def forked(
    command: Sequence[str],
    env: Mapping[str, str],
    *,
    cwd: str | None = None,
    stdin: int = 0,
    stdout: int = 1,
    stderr: int = 2,
    die_with_parent: bool = False,
) -> ForkedProcess | None:
    """``command`` forked by the parent that ``env`` names (:data:`PARENT_ENV`), or None: no parent,
    not ``python -m``, or refused (the caller then starts it itself). ``stdin``/``stdout``/``stderr``
    are file descriptors of this process, passed on."""
    path = env.get(PARENT_ENV)
    if not path or len(command) < 3 or command[1] != "-m":
        return None
    ignored = [int(sig) for sig in PASSED_ON_IGNORED if signal.getsignal(sig) == signal.SIG_IGN]
    request = {
        "argv": list(command), "env": dict(env), "cwd": os.path.abspath(cwd or os.getcwd()),
        "die_with_parent": die_with_parent, "ignored": ignored,
    }  # fmt: skip
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        sock.settimeout(ANSWER_WAIT_S)
        sock.connect(path)
        socket.send_fds(sock, [json.dumps(request).encode()], [stdin, stdout, stderr])
        answer = json.loads(sock.recv(65536) or b"{}")
        if not answer.get("ready"):
            raise OSError(answer.get("why") or "the parent closed the connection")
        sock.settimeout(None)
        return ForkedProcess(sock, int(answer["pid"]), command)
    except (OSError, ValueError):
        sock.close()
        return None


# --- the parent's side ------------------------------------------------------------------------------


def refusal(request: dict[str, Any], peer_pid: int, uid: int, env: dict[str, str]) -> str | None:
    """Why a process forked here for ``request`` would differ from the one ``python`` would start, or None."""
    argv = request.get("argv") or []
    if uid != os.getuid():
        return "another user"
    if len(argv) < 3 or argv[0] != sys.executable or argv[1] != "-m":
        return f"not `{sys.executable} -m MODULE`"
    folder = str(request.get("cwd"))
    if folder != sys.path[0] and (why := imports_otherwise_in(folder)):
        return f"another folder ({folder}: {why})"
    if names := env_differences(request.get("env") or {}, env):  # names alone: values may be secrets
        return f"another environment ({', '.join(names)})"
    if others := [space for space in NAMESPACES if namespace(peer_pid, space) != namespace(os.getpid(), space)]:
        # Not joined, as the zygote parent's children do: imports here cache what a host is (Celery
        # memoizes the host name as it imports), and a process forked into a fleet test's host would
        # take this machine's.
        return f"other namespaces ({', '.join(others)})"
    return None


def serve(listener: socket.socket, env: dict[str, str]) -> None:
    """Per connection: refuse, or fork a keeper that starts the process and reports on it."""
    keepers: set[int] = set()
    while True:
        readable, _, _ = select.select([listener], [], [], 0.2)
        if readable:
            conn, _ = listener.accept()
            fds: list[int] = []
            with contextlib.suppress(OSError, ValueError):  # a requester that went away or sent garbage
                conn.settimeout(5.0)
                message, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
                request = json.loads(message)
                peer_pid, uid, _ = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
                why = refusal(request, peer_pid, uid, env) if len(fds) == 3 else "three descriptors expected"
                if why is not None:
                    print(f"worker.service_parent: refused {request.get('argv')}: {why}", file=sys.stderr, flush=True)
                    conn.send(json.dumps({"ready": False, "why": why}).encode())
                else:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    pid = os.fork()
                    if pid == 0:
                        listener.close()
                        keep(conn, request, fds)  # never returns
                    keepers.add(pid)
            for fd in fds:
                os.close(fd)
            conn.close()
        for pid in list(keepers):
            if os.waitpid(pid, os.WNOHANG)[0]:
                keepers.discard(pid)


def keep(conn: socket.socket, request: dict[str, Any], fds: list[int]) -> None:
    """In the keeper: fork the process, report its pid and then its exit."""
    code = 0
    try:
        conn.settimeout(None)
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            conn.close()
            become(request, fds, ready_w)  # never returns
        os.close(ready_w)
        for fd in fds:
            os.close(fd)
        with os.fdopen(ready_r, "rb") as ready:
            said = ready.read()
        if said != b"ok":
            os.waitpid(pid, 0)
            why = said.decode(errors="replace") or "the process died while being set up"
            conn.send(json.dumps({"ready": False, "why": why}).encode())
            return
        conn.send(json.dumps({"ready": True, "pid": pid}).encode())
        watch(conn, pid, bool(request.get("die_with_parent")))
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        os._exit(code)


def watch(conn: socket.socket, pid: int, die_with_parent: bool) -> None:
    """Until ``pid`` exits, then tell the requester its status; SIGTERM it if the requester dies first
    and ``die_with_parent`` (what ``prctl(PR_SET_PDEATHSIG)`` does for a child of the requester's own)."""
    process = os.pidfd_open(pid)
    watched: list[Any] = [conn, process]
    while True:
        readable, _, _ = select.select(watched, [], [])
        if conn in readable:
            with contextlib.suppress(OSError):
                conn.recv(1)  # only its end comes: the requester sends nothing more
            watched.remove(conn)
            if die_with_parent:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        if process in readable:
            _, status = os.waitpid(pid, 0)
            with contextlib.suppress(OSError):
                conn.send(json.dumps({"exit": os.waitstatus_to_exitcode(status)}).encode())
            return


_title: list[Any] = []  # the buffers /proc/self/cmdline and environ point at, kept for the process's life


def set_proc_strings(argv: Sequence[str], env: Mapping[str, str]) -> str | None:
    """Point ``/proc/self/cmdline`` and ``environ`` at ``argv`` and ``env`` (``PR_SET_MM_MAP``, which
    needs no capability when the executable stays); why not, or None."""

    class MMMap(ctypes.Structure):  # struct prctl_mm_map
        _fields_ = [
            (name, ctypes.c_uint64)
            for name in ("start_code", "end_code", "start_data", "end_data", "start_brk", "brk", "start_stack",
                         "arg_start", "arg_end", "env_start", "env_end", "auxv")
        ] + [("auxv_size", ctypes.c_uint32), ("exe_fd", ctypes.c_uint32)]  # fmt: skip

    libc = ctypes.CDLL(None, use_errno=True)
    libc.sbrk.restype = ctypes.c_void_p
    libc.sbrk.argtypes = [ctypes.c_long]
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    args_raw = b"".join(arg.encode() + b"\0" for arg in argv)
    env_raw = b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()) or b"\0"
    args_buf = ctypes.create_string_buffer(args_raw, len(args_raw))
    env_buf = ctypes.create_string_buffer(env_raw, len(env_raw))
    with open("/proc/self/stat", encoding="utf-8") as stat_file:
        text = stat_file.read()
    fields = text[text.rindex(")") + 2 :].split()

    def field(number: int) -> int:  # proc(5)'s numbering: fields 1 and 2 precede the state
        return int(fields[number - 3])

    mm = MMMap(
        start_code=field(26), end_code=field(27), start_data=field(45), end_data=field(46), start_brk=field(47),
        brk=libc.sbrk(0), start_stack=field(28), arg_start=ctypes.addressof(args_buf),
        arg_end=ctypes.addressof(args_buf) + len(args_raw), env_start=ctypes.addressof(env_buf),
        env_end=ctypes.addressof(env_buf) + len(env_raw), auxv=0, auxv_size=0, exe_fd=0xFFFFFFFF,
    )  # fmt: skip
    if libc.prctl(PR_SET_MM, PR_SET_MM_MAP, ctypes.addressof(mm), ctypes.sizeof(mm), 0) != 0:
        return f"cannot set its command line: {os.strerror(ctypes.get_errno())}"
    _title.extend([args_buf, env_buf])
    return None


def become(request: dict[str, Any], fds: list[int], ready: int) -> None:
    """In the forked process: turn into ``python -m MODULE ARGS`` as the request describes; never returns."""
    code = 1
    try:
        os.setsid()
        argv, env = list(request["argv"]), dict(request["env"])
        if (why := set_proc_strings(argv, env)) is not None:
            os.write(ready, why.encode())
            os._exit(1)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        ignored = set(request.get("ignored") or [])
        for sig in PASSED_ON_IGNORED:
            default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
            signal.signal(sig, signal.SIG_IGN if sig in ignored else default)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(env)
        sys.path[0] = request["cwd"]
        _fresh_stdio(unbuffered=bool(env.get("PYTHONUNBUFFERED")))
        os.write(ready, b"ok")
        os.close(ready)
        code = _run_module(argv[2], argv[3:])
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _fresh_stdio(unbuffered: bool) -> None:
    """sys.stdin/stdout/stderr on descriptors 0-2 as a new interpreter opens them (``-u`` or not)."""

    def text(fd: int, mode: str, line: bool) -> io.TextIOWrapper:
        old = {0: sys.__stdin__, 1: sys.__stdout__, 2: sys.__stderr__}[fd]
        raw = io.FileIO(fd, mode, closefd=False)
        buffered: Any = raw
        if not (unbuffered and mode == "w"):
            buffered = io.BufferedWriter(raw) if mode == "w" else io.BufferedReader(raw)
        encoding = old.encoding if old is not None else "utf-8"
        errors = old.errors if old is not None else "strict"
        return io.TextIOWrapper(buffered, encoding=encoding, errors=errors, line_buffering=line,
                                write_through=unbuffered and mode == "w")  # fmt: skip

    for name, stream in (("stdin", text(0, "r", False)), ("stdout", text(1, "w", os.isatty(1))),
                         ("stderr", text(2, "w", True))):  # fmt: skip
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _run_module(module: str, args: list[str]) -> int:
    """``python -m module args`` in this process, and then what the interpreter's exit does."""
    imported = sys.modules.get(module)
    if imported is not None and not hasattr(imported, "__path__"):  # a package runs its __main__, not itself
        del sys.modules[module]  # as in a new interpreter; run_module would warn of a module imported already
    sys.argv = [module, *args]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:
        traceback.print_exc()
        code = -signal.SIGINT
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        threading._shutdown()  # type: ignore[attr-defined]  # non-daemon threads end first, as at exit
        with contextlib.suppress(BaseException):
            import atexit

            atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
    if code == -signal.SIGINT:  # an interpreter ended by Ctrl-C dies of SIGINT
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    return code


def main(argv: list[str] | None = None) -> int:
    from trainer_core.preimport import preimport, unsafe_to_fork

    args = sys.argv[1:] if argv is None else argv
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the processes, not this
    env = dict(os.environ)  # before the imports, some of which write to it
    for name, exc in preimport((*PREIMPORTS, *args[1:])).items():
        print(f"worker.service_parent: {name} not preimported: {type(exc).__name__}: {exc}", file=sys.stderr)
    unsafe = unsafe_to_fork()
    if SETTINGS_READ_AT_IMPORT in sys.modules:
        unsafe = f"{SETTINGS_READ_AT_IMPORT} was imported (it reads the settings as it imports)"
    if unsafe is not None:
        print(f"worker.service_parent: cannot fork: {unsafe}", file=sys.stderr)
        return 1
    serve(listen_at(args[0]), env)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
