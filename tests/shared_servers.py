"""Servers one ``pytest`` run shares across its xdist workers: started once per run, not once per worker.

The S3 store (``weed mini``) and the MLflow server take seconds of CPU each to start, and every test
uses them the same way (a prefix or an experiment of its own). As plain session fixtures each xdist
worker whose tests ask for one started its own: three of each on ``make test``. Here the first process
to ask starts it, detached, and writes how to reach it into the run's folder; the others read that
(a file lock orders them). The process that made the folder, the xdist controller (or a serial run's
only process), stops every server in it when the run ends: no worker can, since another may still be
using the server when the first worker is done.

A ``pytest`` started by a test inherits the folder and uses the same servers, and stops none.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from worker.procfs import all_processes
from worker.supervisor import kill_group

FOLDER_ENV = "TRAINJOBS_TESTS_SHARED_SERVERS"  # set by the run's first process, inherited by its workers
OWNER_ENV = "TRAINJOBS_TESTS_SHARED_SERVERS_OWNER"  # that process's pid: only it stops the servers
STOP_WAIT_S = 15.0


def claim_folder() -> None:
    """Make this run's folder, unless a process above this one made it (call from pytest_configure)."""
    if os.environ.get(FOLDER_ENV):
        return
    os.environ[FOLDER_ENV] = tempfile.mkdtemp(prefix="trainjobs-tests-servers-")
    os.environ[OWNER_ENV] = str(os.getpid())


def shared_server(name: str, start: Callable[[], tuple[dict[str, Any], int]]) -> dict[str, Any]:
    """The fields that reach server ``name``: read if another process started it, else ``start()``-ed
    here. ``start`` returns the fields (JSON) and the process group to stop at the end of the run."""
    folder = Path(os.environ[FOLDER_ENV])
    with (folder / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        described = folder / f"{name}.json"
        if described.is_file():
            return dict(json.loads(described.read_text(encoding="utf-8"))["fields"])
        fields, group = start()
        described.write_text(json.dumps({"fields": fields, "group": group}), encoding="utf-8")
        return fields


def stop_servers() -> None:
    """Stop every server started in this run's folder and remove it, if this process made it (call
    from pytest_unconfigure). SIGTERM to each process group, SIGKILL to any left after a while."""
    folder = os.environ.get(FOLDER_ENV)
    if not folder or os.environ.get(OWNER_ENV) != str(os.getpid()):
        return
    groups = {json.loads(path.read_text(encoding="utf-8"))["group"] for path in Path(folder).glob("*.json")}
    for group in groups:
        kill_group(group, signal.SIGTERM)
    deadline = time.monotonic() + STOP_WAIT_S
    # Zombies do not count: a serial run started the servers, and its children stay zombies until it exits.
    while any(p.alive and p.pgid in groups for p in all_processes()) and time.monotonic() < deadline:
        time.sleep(0.1)
    for group in groups:
        kill_group(group)
    shutil.rmtree(folder, ignore_errors=True)
