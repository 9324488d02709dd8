"""The README's promise, checked on a fresh copy of the repository: its first command brings the
service up, the printed ``curl`` submits the example job, the job succeeds, and Ctrl-C stops it all.

The copy holds what a clone would (tracked files plus the working changes, nothing ignored). To stay
fast it reuses the suite's virtual environment (``VENV``, which the Makefile honours; the copy's code
comes first on ``PYTHONPATH``) instead of installing torch again.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.trainjobs.live import REPO, free_port
from worker.procfs import all_processes, cmdline

pytestmark = pytest.mark.slow

STARTUP_TIMEOUT_S = 180
JOB_TIMEOUT_S = 300


def fresh_copy(target: Path) -> Path:
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO, check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_file():  # a file deleted in the working tree is not part of the clone
            (target / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target / name)
    return target


def first_command(readme: str) -> str:
    block = re.search(r"```sh\n(.*?)```", readme, re.S)
    assert block is not None, "the README has no sh block"
    return block.group(1).splitlines()[0].split("#")[0].strip()


def processes_in(folder: Path) -> list[int]:
    """Live processes started from ``folder`` or naming it on their command line."""
    found = []
    for proc in all_processes():
        if proc.pid == os.getpid() or not proc.alive:
            continue
        try:
            cwd = os.readlink(f"/proc/{proc.pid}/cwd")
        except OSError:
            continue
        if cwd.startswith(str(folder)) or str(folder).encode() in cmdline(proc.pid):
            found.append(proc.pid)
    return found


def wait_for_line(process: subprocess.Popen[str], pattern: str, timeout: float) -> tuple[str, list[str]]:
    """Read stdout until a line matches ``pattern``; returns it and everything read."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout
    assert process.stdout is not None
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        seen.append(line)
        if re.search(pattern, line):
            return line.strip(), seen
    tail = "".join(seen[-60:])
    raise AssertionError(f"no line matching {pattern!r}; output:\n{tail}")


def test_make_run_then_the_printed_curl_trains_the_example(tmp_path: Path) -> None:
    venv = Path(sys.executable).parent.parent
    pyproject_hash = hashlib.sha1((REPO / "pyproject.toml").read_bytes()).hexdigest()[:12]
    # Otherwise make would reinstall into the shared environment from the copy.
    assert (venv / f".installed-{pyproject_hash}").exists(), "the virtualenv is not current: run `make venv`"
    clone = fresh_copy(tmp_path / "clone")
    command = first_command((clone / "README.md").read_text())
    assert command == "make run"

    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINJOBS_", "DATABASE_URL", "BROKER_URL",
                                                                     "ARTIFACTS_ROOT", "DATA_ROOT"))}  # fmt: skip
    env.update(VENV=str(venv), PYTHONPATH=str(clone), TRAINJOBS_PORT=str(port), PYTHONUNBUFFERED="1")
    process = subprocess.Popen(shlex.split(command), cwd=clone, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    try:
        curl, _ = wait_for_line(process, r"^\s*curl ", STARTUP_TIMEOUT_S)
        submitted = subprocess.run(curl, shell=True, cwd=clone, capture_output=True, text=True, timeout=60)
        assert submitted.returncode == 0, submitted.stderr
        job = json.loads(submitted.stdout)
        assert job["status"] == "queued", job
        key = re.search(r"Bearer (\S+?)'", curl)
        assert key is not None
        headers = {"Authorization": f"Bearer {key.group(1)}"}
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while time.monotonic() < deadline:
            job = httpx.get(f"http://127.0.0.1:{port}/v1/jobs/{job['id']}", headers=headers, timeout=10).json()
            if job["status"] in ("succeeded", "failed", "cancelled"):
                break
            time.sleep(1.0)
        assert job["status"] == "succeeded", job
        assert job["final_metrics"], job
        assert (clone / "var" / "trainjobs.db").is_file()  # the embedded defaults live under ./var
    finally:
        os.killpg(process.pid, signal.SIGINT)  # Ctrl-C in the terminal: make and the launcher
        try:
            process.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            raise
    leftovers = processes_in(clone)
    for pid in leftovers:
        os.kill(pid, signal.SIGKILL)
    assert leftovers == [], "processes outlived Ctrl-C"
