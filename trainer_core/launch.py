"""Several processes: run the same job under torchrun and relay rank 0's events to the caller.

``run_distributed`` starts ``python -m torch.distributed.run --nproc_per_node N -m trainer_core.rank_entry``;
each rank (:mod:`trainer_core.rank_entry`) calls :func:`trainer_core.run.train_job` (gloo on CPU, nccl on
GPU, chosen by accelerate) and rank 0 prints its events as JSON lines, which the parent parses and forwards.

A job of several nodes (``resources.num_nodes``) runs the same command on each machine with torchrun's
c10d rendezvous instead of ``--standalone``: ``--nnodes N --rdzv-backend c10d --rdzv-endpoint HOST:PORT
--rdzv-id ID``, the same endpoint and id everywhere (:class:`Rendezvous`). The rendezvous decides which
node holds rank 0, whose launcher relays the job's events; another node's launcher reports only how its
own ranks ended.

Where it is safe (:func:`trainer_core.preimport.unsafe_to_fork`: one Python thread, no CUDA, no
process group), the launcher is not a new interpreter but a fork of this process, running torchrun's
own code (the same arguments, rendezvous, signal handling and failure rules) with ``--start-method
fork`` and the rank's entry module's ``main`` as a function: its ranks are forks too, with torch,
transformers and the backend imported already. A fresh interpreter spends ~6 s of CPU on those
imports (trainer_core/preimport.py), each rank and the launcher its own. Elsewhere (a GPU process
that has started CUDA, a caller with threads: a notebook, a tracker's) it starts ``python -m
torch.distributed.run`` as before.

This module does not import :mod:`trainer_core.run` (which imports it), so the two form no circle.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from trainer_core.events import Event, EventSink, RunStatus, make_event, parse_event_line
from trainer_core.path_guard import Reach
from trainer_core.preimport import stop_tqdm_monitors, unsafe_to_fork
from trainer_core.spec import FieldError, JobSpec, SpecError

logger = logging.getLogger(__name__)


# The ``done`` summary key of a node without rank 0: its ranks finished, the job's end is another node's.
OTHER_NODE = "node"
TORCHRUN = (sys.executable, "-m", "torch.distributed.run")
# Each rank's entry, ``-m`` in torchrun's arguments: a new interpreter runs the module, a forked rank
# calls its ``main``. Named, not imported: it trains through trainer_core.run, which imports this module.
RANK_MODULE = "trainer_core.rank_entry"
SIBLING_FORK_WAIT_S = 60.0  # a forked rank's longest wait for its siblings' forks (_await_sibling_forks)


@dataclass(frozen=True)
class Rendezvous:
    """Where the nodes of a multi-node run meet: torchrun's c10d store at ``endpoint`` (``HOST:PORT``),
    for the run ``run_id`` (the same on every node).

    ``is_host``: whether this node serves the store (None: torchrun guesses, by matching the endpoint
    against this machine's host name and addresses, which fails where the host name does not resolve).
    ``local_addr``: the address the other nodes reach this one at (None: its fully qualified host name).
    """

    endpoint: str
    run_id: str
    local_addr: str | None = None
    is_host: bool | None = None

    def cli_args(self) -> list[str]:
        """The same rendezvous as ``python -m trainer_core`` arguments (trainer_core/cli.py reads them)."""
        args = ["--rdzv-endpoint", self.endpoint, "--rdzv-id", self.run_id]
        if self.local_addr is not None:
            args += ["--rdzv-local-addr", self.local_addr]
        if self.is_host is not None:
            args.append("--rdzv-host" if self.is_host else "--no-rdzv-host")
        return args

    def args(self, nodes: int) -> list[str]:
        """torchrun's arguments for this node."""
        args = [f"--nnodes={nodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={self.endpoint}",
                f"--rdzv-id={self.run_id}"]  # fmt: skip
        if self.is_host is not None:
            args.append(f"--rdzv-conf=is_host={int(self.is_host)}")
        if self.local_addr is not None:
            args.append(f"--local-addr={self.local_addr}")
        return args


def torchrun_command(
    spec_path: Path, output_dir: Path, nproc: int, *, resume: bool, stop_file: Path | None, cache_dir: Path | None,
    reach: Reach | None = None, nodes: int = 1, rendezvous: Rendezvous | None = None,
) -> list[str]:
    """The torchrun command line for one job's processes on this node (one node: ``--standalone``, a free
    local rendezvous port; several: ``rendezvous``)."""
    # One node: its processes meet on the loopback (by default torchrun publishes the host name, which
    # a machine that cannot resolve its own name, a container or a fresh VM, never reaches).
    where = ["--standalone", "--local-addr=127.0.0.1"] if rendezvous is None else rendezvous.args(nodes)
    cmd = [*TORCHRUN, *where, f"--nproc_per_node={nproc}", "-m", RANK_MODULE, str(spec_path),
           "--output-dir", str(output_dir)]  # fmt: skip
    if resume:
        cmd.append("--resume")
    if stop_file is not None:
        cmd += ["--stop-file", str(stop_file)]
    if cache_dir is not None:
        cmd += ["--cache-dir", str(cache_dir)]
    if reach is not None:  # each rank opens the data and the model itself: each checks the paths again
        cmd += reach.args()
    return cmd


def _spec_error_from(done: Event) -> SpecError | None:
    summary = done.get("summary") or {}
    if not summary.get("errors"):  # field errors: a SpecError (invalid_spec, data_error or model_error)
        return None
    return SpecError([FieldError(e["field"], e["message"]) for e in summary.get("errors", [])])


def run_distributed(
    spec: JobSpec,
    output_dir: Path,
    *,
    emit: EventSink,
    resume: bool = False,
    stop_file: Path | None = None,
    cache_dir: Path | None = None,
    reach: Reach | None = None,
    rendezvous: Rendezvous | None = None,
) -> RunStatus:
    """Run ``spec`` on ``spec.resources.num_processes`` local processes (this node's share of the job);
    returns rank 0's status, or on a node without rank 0 how its own ranks ended."""
    output_dir.mkdir(parents=True, exist_ok=True)
    spec_path = output_dir / "spec.json"
    spec_path.write_text(spec.model_dump_json(indent=2), encoding="utf-8")
    cmd = torchrun_command(spec_path, output_dir, spec.resources.num_processes, resume=resume, stop_file=stop_file,
                           cache_dir=cache_dir, reach=reach, nodes=spec.resources.num_nodes, rendezvous=rendezvous)
    why_not = why_ranks_are_not_forked()
    proc: subprocess.Popen[str] | ForkedLauncher
    if why_not is None:
        proc = ForkedLauncher(cmd[len(TORCHRUN) :])
        logger.info("the ranks are forks of this process (torchrun's launcher is its child %d)", proc.pid)
    else:
        logger.info("torchrun starts the ranks as new interpreters: this process cannot fork them (%s)", why_not)
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    previous = None
    if threading.current_thread() is threading.main_thread():
        # torchrun (either launcher) passes SIGTERM on to its ranks, which stop after their current step.
        previous = signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signal.SIGTERM))
    done: Event | None = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            event = parse_event_line(line)
            if event is None:
                logger.debug("rank: %s", line.rstrip())
                continue
            if event["event"] == "done":
                done = event
            emit(event)
        returncode = proc.wait()
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if proc.poll() is None:  # the caller was interrupted: do not leave ranks behind
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    if done is None and returncode == 0 and rendezvous is not None:
        # Rank 0 ran on another node, which reports the job; this node's ranks all finished.
        emit(make_event("done", status="succeeded", summary={OTHER_NODE: "without rank 0: the job's events are its"}))
        return "succeeded"
    if done is None:
        failed = {"reason": "internal", "error": f"torchrun exited with status {returncode}"}
        if rendezvous is not None:  # a node without rank 0: the job's own end and outputs are rank 0's node's
            failed[OTHER_NODE] = "without rank 0"
        emit(make_event("done", status="failed", summary=failed))
        return "failed"
    error = _spec_error_from(done)
    if error is not None:
        raise error
    status: RunStatus = done["status"]
    return status


def why_ranks_are_not_forked() -> str | None:
    """Why :func:`run_distributed` would start its ranks as new interpreters here, or None when it would
    fork them. tqdm's monitor thread, which the first progress bar leaves behind, is stopped first."""
    stop_tqdm_monitors()
    return unsafe_to_fork()


class ForkedLauncher:
    """torchrun's launcher in a fork of this process, driven like ``subprocess.Popen`` (what
    :func:`run_distributed` uses of it): its ranks' stdout is ``self.stdout``. ``torchrun_args`` name
    the rank's entry as a module (``-m MODULE ARGS``), whose ``main(ARGS)`` each forked rank calls.

    It stays in this process's group, as ``Popen``'s child does: a worker slot sweeps the run's whole
    group (worker/supervisor.py)."""

    def __init__(self, torchrun_args: list[str]) -> None:
        read_end, write_end = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the launcher: never returns
            os.close(read_end)
            _become_launcher(torchrun_args, write_end)
        os.close(write_end)
        self.pid = pid
        self.returncode: int | None = None
        self.stdout: IO[str] = os.fdopen(read_end, "r", encoding="utf-8")

    def poll(self) -> int | None:
        if self.returncode is None:
            done, status = os.waitpid(self.pid, os.WNOHANG)
            if done:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        if deadline is None and self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(list(TORCHRUN), timeout or 0)
            time.sleep(0.05)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _become_launcher(torchrun_args: list[str], stdout_fd: int) -> None:
    """In the forked child: run torchrun's launcher over ``torchrun_args``, its ranks forked from here,
    and exit with torchrun's status (0, or 1 when a rank failed)."""
    code = 1
    try:
        os.dup2(stdout_fd, 1)
        os.close(stdout_fd)
        # The streams the ranks write, on descriptors 1 and 2 whatever this process had made of
        # sys.stdout (a test runner's capture, a progress bar).
        sys.stdout = open(1, "w", encoding="utf-8", buffering=1, closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", encoding="utf-8", buffering=1, closefd=False)  # noqa: SIM115
        # A new interpreter's logging: no handler of this process's (one of a test runner's swaps the
        # streams back to its own capture as it writes); each rank configures its own (rank_entry).
        for handler in list(logging.root.handlers):
            logging.root.removeHandler(handler)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # torchrun installs its own
            signal.signal(sig, signal.SIG_DFL)
        code = _launch_forked_ranks(torchrun_args)
    except BaseException:
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)  # not the parent's atexit handlers, trackers or finalizers


def _launch_forked_ranks(torchrun_args: list[str]) -> int:
    """What ``python -m torch.distributed.run ARGS`` does (torch/distributed/run.py: ``run``), with the
    rank's entry module's ``main`` called in forked processes instead of ``python -m MODULE`` in new ones."""
    import importlib

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    args = torchrun.parse_args(torchrun_args)
    if not args.module:
        raise ValueError(f"a forked rank calls a module's main: -m MODULE, not the script {args.training_script}")
    importlib.import_module(args.training_script)  # here, once: every rank is forked with it imported
    if args.standalone:
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    config, _, _ = torchrun.config_from_args(args)
    config.start_method = "fork"
    try:
        elastic_launch(config, entrypoint=_forked_rank)(args.training_script, *args.training_script_args)
    except ChildFailedError as exc:
        print(exc.format_msg(), file=sys.stderr)
        return 1
    return 0


def _forked_rank(module: str, *rank_args: str) -> None:
    """One rank, forked by :func:`_launch_forked_ranks`: ``python -m MODULE RANK_ARGS`` (a module whose
    ``main(argv)`` returns the rank's status, as :mod:`trainer_core.rank_entry`'s does) without the new
    interpreter. A non-zero status leaves the process non-zero, as the module's would, so that torchrun
    stops the other ranks."""
    import importlib

    import torch

    _await_sibling_forks()
    if threads := os.environ.get("OMP_NUM_THREADS"):  # torchrun's choice: a new interpreter reads it at start
        torch.set_num_threads(int(threads))
    if "accelerate.state" in sys.modules:
        # What accelerate keeps per process (the distributed setup, the accumulation state) as a new
        # interpreter has it: empty. A parent that trained in-process before (a test, a notebook) set
        # it up for a world of one.
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()
    status = importlib.import_module(module).main(list(rank_args))
    if status:
        raise SystemExit(status)


def _await_sibling_forks(timeout_s: float = SIBLING_FORK_WAIT_S) -> None:
    """In a forked rank, before its work: until the launcher has forked every rank of this node.

    The launcher is torchrun's agent, whose stores are served by threads of their own, set to work by
    each rank that connects. A rank forked while one of them is inside glibc's resolver (torch names
    a socket's peer with getnameinfo) inherits the resolver's lock taken by a thread it does not have,
    and hangs in getnameinfo at its own first connection (in a clean-clone suite run, three ranks
    waited for the fourth until the test's timeout). So no rank of this node connects while its
    siblings are being forked. (A multi-node run's other nodes may still connect to a store on this
    node meanwhile.)
    Where /proc lists no children (not Linux), or past ``timeout_s``, it goes on."""
    wanted = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    launcher = os.getppid()
    # Read here, not with worker/procfs.py:children_of: the engine imports nothing of the service.
    children = Path(f"/proc/{launcher}/task/{launcher}/children")
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if len(children.read_text().split()) >= wanted:
                return
        except OSError:
            return
        time.sleep(0.001)
    logger.warning("rank %s: the launcher forked fewer than %d ranks in %.0f s; going on",
                   os.environ.get("LOCAL_RANK"), wanted, timeout_s)  # fmt: skip
