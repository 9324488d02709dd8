"""Where one job's run lives on this worker, and how a job names the worker running it.

Both the runner (execute.py) and recovery (recovery.py) need these; they live here so that neither
of the two imports the other to find them.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from pathlib import Path

from service_core.runs import RUN_LOG_NAME, run_work_dir
from service_core.settings import Settings


@dataclass(frozen=True)
class RunPaths:
    """Where one job's run reads and writes on this worker."""

    work_dir: Path  # settings.home/runs/<job_id>: spec, pid file, stop file, log
    output_dir: Path  # what the trainer writes (the artifacts folder itself when that is local)
    cache_dir: Path  # preprocessing cache, shared by all jobs on this worker

    @property
    def spec_file(self) -> Path:
        return self.work_dir / "spec.json"

    @property
    def log_file(self) -> Path:
        return self.work_dir / RUN_LOG_NAME

    @property
    def pid_file(self) -> Path:
        return self.work_dir / "run.pid"

    @property
    def stop_file(self) -> Path:
        return self.work_dir / "STOP"


def worker_name() -> str:
    """How a job records which machine runs it (recovery compares it with its own host)."""
    return socket.gethostname()


def is_local_root(root: str) -> bool:
    return "://" not in root or root.startswith("file://")


def run_paths(job_id: str, settings: Settings) -> RunPaths:
    """A local artifacts root is trained into directly; otherwise a working dir is uploaded at the end."""
    work_dir = run_work_dir(settings.home, job_id)
    root = settings.artifacts_root
    if is_local_root(root):
        output_dir = Path(root.removeprefix("file://")).resolve() / job_id
    else:
        output_dir = work_dir / "output"
    return RunPaths(work_dir=work_dir, output_dir=output_dir, cache_dir=(settings.home / "cache").resolve())
