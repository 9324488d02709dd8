"""Several processes: run the same job under torchrun and relay rank 0's events to the caller.

``run_distributed`` starts ``python -m torch.distributed.run --nproc_per_node N -m trainer_core.rank_entry``;
each rank (:mod:`trainer_core.rank_entry`) calls :func:`trainer_core.run.train_job` (gloo on CPU, nccl on
GPU, chosen by accelerate) and rank 0 prints its events as JSON lines, which the parent parses and forwards.

A job of several nodes (``resources.num_nodes``) runs the same command on each machine with torchrun's
c10d rendezvous instead of ``--standalone``: ``--nnodes N --rdzv-backend c10d --rdzv-endpoint HOST:PORT
--rdzv-id ID``, the same endpoint and id everywhere (:class:`Rendezvous`). The rendezvous decides which
node holds rank 0, whose launcher relays the job's events; another node's launcher reports only how its
own ranks ended.

This module does not import :mod:`trainer_core.run` (which imports it), so the two form no circle.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

from trainer_core.events import Event, EventSink, RunStatus, make_event, parse_event_line
from trainer_core.path_guard import Reach
from trainer_core.spec import FieldError, JobSpec, SpecError

logger = logging.getLogger(__name__)


# The ``done`` summary key of a node without rank 0: its ranks finished, the job's end is another node's.
OTHER_NODE = "node"


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
    cmd = [sys.executable, "-m", "torch.distributed.run", *where, f"--nproc_per_node={nproc}",
           "-m", "trainer_core.rank_entry", str(spec_path), "--output-dir", str(output_dir)]
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
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)
    previous = None
    if threading.current_thread() is threading.main_thread():
        # torchrun passes SIGTERM on to its ranks, which stop after their current step.
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
