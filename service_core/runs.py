"""Where a job's run lives on the machine that runs it: one layout for the worker, which writes it,
and the API, which reads a running job's live log from it (the same machine on the embedded default).
"""

from __future__ import annotations

from pathlib import Path

# The run's combined stdout/stderr; stored with the artifacts under the same name when the run ends.
RUN_LOG_NAME = "worker.log"


def run_work_dir(home: Path, job_id: str) -> Path:
    """``<home>/runs/<job_id>``: the run's spec, pid file, stop file and log."""
    return (home / "runs" / job_id).resolve()


def node_log_name(node: int) -> str:
    """Node ``node``'s run log of a multi-node job (worker/gang.py), stored beside :data:`RUN_LOG_NAME`."""
    return f"node-{node}.log"
