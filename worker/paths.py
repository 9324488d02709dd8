"""Where one job's run lives on this host, and how a job names the host running it.

Both the slot's side (execute.py) and recovery (recovery.py) need these; they live here so that neither
of the two imports the other to find them.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

from service_core.datastore import CACHE_DIR
from service_core.runs import RUN_LOG_NAME, run_work_dir
from service_core.settings import Settings
from trainer_core.path_guard import Reach


@dataclass(frozen=True)
class RunPaths:
    """Where one job's run reads and writes on this host."""

    work_dir: Path  # settings.home/runs/<job_id>: spec, pid file, stop file, log
    output_dir: Path  # what the trainer writes (the artifacts folder itself when that is local)
    cache_dir: Path  # preprocessing cache, shared by all jobs on this host
    # The local paths the run may open, checked again as it opens them (trainer_core/path_guard.py).
    reach: Reach | None = None

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


def host_name() -> str:
    """How a job records which machine runs it (in the job row's ``worker`` column; recovery compares
    it with its own host)."""
    return socket.gethostname()


def process_name() -> str:
    """This process's ``host-pid``: a worker's name in its main process, a slot's in the slot."""
    return f"{host_name()}-{os.getpid()}"


# A worker passes its name (:func:`process_name` in its main process) to its slots here: a slot's parent
# process need not be its worker (the suite forks slots elsewhere: worker/service_parent.py).
WORKER_NAME_ENV = "TRAINJOBS_WORKER_NAME"


def worker_of_slot() -> str:
    """In a slot, its worker's name: the one its worker passed, else its parent process's ``host-pid``."""
    return os.environ.get(WORKER_NAME_ENV) or f"{host_name()}-{os.getppid()}"


def is_local_root(root: str) -> bool:
    return "://" not in root or root.startswith("file://")


def run_reach(settings: Settings, owner: str, reads_all_uploads: bool) -> Reach:
    """What a job's run may read on this host: the local data root within its owner's reach (every upload
    when an admin submitted it), or on an object-store data root this host's cache of the store, where
    the worker puts the files the API checked there (objects have no links to follow)."""
    root = settings.data_root_url
    if "://" in root:
        return Reach((settings.home.resolve() / CACHE_DIR).as_posix())
    return Reach(root, None if reads_all_uploads else owner)


def run_paths(job_id: str, settings: Settings, reach: Reach | None = None) -> RunPaths:
    """A local artifacts root is trained into directly; otherwise a working dir is uploaded at the end.
    ``reach``: what a run started from these paths may read (:func:`run_reach`)."""
    work_dir = run_work_dir(settings.home, job_id)
    root = settings.artifacts_root
    if is_local_root(root):
        output_dir = Path(root.removeprefix("file://")).resolve() / job_id
    else:
        output_dir = work_dir / "output"
    cache_dir = (settings.home / "cache").resolve()
    return RunPaths(work_dir=work_dir, output_dir=output_dir, cache_dir=cache_dir, reach=reach)
