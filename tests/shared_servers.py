"""Servers one ``pytest`` run shares across its xdist workers: started once per run, not once per worker.

The S3 store (``weed mini``) and the MLflow server take seconds of CPU each to start, and every test
uses them the same way (a prefix or an experiment of its own). As plain session fixtures each xdist
worker whose tests ask for one started its own: three of each on ``make test``. Here the first process
to ask starts it, detached, and writes how to reach it into the run's folder; the others read that
(a file lock orders them). The process that made the folder, the xdist controller (or a serial run's
only process), stops every server in it when the run ends: no worker can, since another may still be
using the server when the first worker is done.

A ``pytest`` started by a test inherits the folder and uses the same servers, and stops none.

Two of them are not network servers: the zygote parent (:func:`share_zygote_parent`), which every worker
slot the run starts asks for its pre-imported zygote, and the service parent (:func:`share_service_parent`),
which forks the API processes, workers and slots the tests start.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from worker.procfs import all_processes, is_alive
from worker.run_env import run_environment
from worker.service_parent import PARENT_ENV as SERVICE_PARENT_ENV
from worker.supervisor import kill_group
from worker.zygote import MARKER

REPO = Path(__file__).resolve().parents[1]
FOLDER_ENV = "TRAINJOBS_TESTS_SHARED_SERVERS"  # set by the run's first process, inherited by its workers
OWNER_ENV = "TRAINJOBS_TESTS_SHARED_SERVERS_OWNER"  # that process's pid: only it stops the servers
STOP_WAIT_S = 15.0
ZYGOTE_PARENT = "zygote-parent"  # its name among the servers: its socket, log and record in the folder
ZYGOTE_PARENT_ENV = "TRAINJOBS_ZYGOTE_PARENT"  # the worker setting (service_core/settings.py)
SERVICE_PARENT = "service-parent"


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


def share_zygote_parent() -> None:
    """Start the run's zygote parent (``python -m worker.zygote --parent``, a testing aid) and name its
    socket in ``TRAINJOBS_ZYGOTE_PARENT``, which the xdist workers and every service they start inherit
    (call from pytest_configure, after :func:`claim_folder`).

    Each worker slot imports torch, transformers and peft into a zygote of its own (about 6 s of CPU);
    the suite starts some forty slots. With this, a slot whose interpreter, folder and run environment are
    this parent's gets a zygote forked from it, already imported, which joins the slot's namespaces (a
    fleet host's) (worker/zygote.py:serve_slots); any other (a fresh clone's venv, a test that sets a
    variable runs read) imports its own, as in production. The parent imports while the workers collect
    (:func:`await_parents`)."""
    _share_parent(ZYGOTE_PARENT, ZYGOTE_PARENT_ENV, ["worker.zygote", "--parent", "{path}", MARKER],
                  run_environment(os.environ))  # fmt: skip


def share_service_parent() -> None:
    """Start the run's service parent (``python -m worker.service_parent``, a testing aid) and name its
    socket in ``TRAINJOBS_SERVICE_PARENT`` (call from pytest_configure, after :func:`claim_folder`).

    The API processes, workers and slots the tests start (worker/processes.py:start_detached, and
    worker/processes.py:spawn_child inside services) are then forked from it, imported, where their
    interpreter, folder and environment allow it (worker/service_parent.py says when); about 4 s of CPU
    saved per API process, 1 s per worker or slot. Its environment is this process's."""
    modules = ["api.main", "trainjobs.launcher", "trainjobs.commands.service"]  # what worker/ may not name
    _share_parent(SERVICE_PARENT, SERVICE_PARENT_ENV, ["worker.service_parent", "{path}", *modules], dict(os.environ))


def _share_parent(name: str, variable: str, args: list[str], env: dict[str, str]) -> None:
    if os.environ.get(variable) or os.environ.get(OWNER_ENV) != str(os.getpid()):
        return  # a pytest started by a test (it inherited the variable), or an xdist worker
    folder = Path(os.environ[FOLDER_ENV])

    def start() -> tuple[dict[str, Any], int]:
        path = folder / f"{name}.sock"
        with (folder / f"{name}.log").open("ab") as log:
            argv = [sys.executable, "-m", *(arg.format(path=path) for arg in args)]
            proc = subprocess.Popen(argv, env=env, cwd=REPO, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                    start_new_session=True)  # fmt: skip
        return {"path": str(path)}, proc.pid

    os.environ[variable] = shared_server(name, start)["path"]


def await_parents(timeout_s: float = 120.0) -> str | None:
    """The zygote parent's socket, once it and the service parent listen (each binds its socket only
    after its imports), or while one is gone or still importing past ``timeout_s``; None in a run
    without them."""
    deadline = time.monotonic() + timeout_s
    for name, variable in ((SERVICE_PARENT, SERVICE_PARENT_ENV), (ZYGOTE_PARENT, ZYGOTE_PARENT_ENV)):
        path = os.environ.get(variable)
        folder = os.environ.get(FOLDER_ENV)
        if not path or not folder:
            continue
        described = Path(folder) / f"{name}.json"  # shared_server's record: the parent's pid
        pid = json.loads(described.read_text(encoding="utf-8"))["group"] if described.is_file() else None
        while not Path(path).exists() and is_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
    return os.environ.get(ZYGOTE_PARENT_ENV)


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
