"""The suite's service parent (worker/service_parent.py, a testing aid): a process it forks is the one
``python -m`` would start, as far as the process can tell; it reports the exit status, dies with its
requester when asked to, and is refused wherever it could differ."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fleet.netns import netns_unavailable
from tests.shared_servers import await_parents
from tests.trainjobs.live import REPO
from worker.procfs import cmdline, environ, is_alive
from worker.service_parent import PARENT_ENV, ForkedProcess, forked

PROBE = [sys.executable, "-m", "tests.worker.service_probe"]


@pytest.fixture
def parent_env() -> Iterator[dict[str, str]]:
    """This process's environment, naming the suite's service parent once it listens."""
    await_parents()
    path = os.environ.get(PARENT_ENV)
    assert path is not None and Path(path).exists(), f"no service parent listening at {path}"
    yield {**os.environ, "TRAINJOBS_PROBE": "from the request"}


def probe_output(log: Path) -> tuple[dict[str, Any], list[str]]:
    first, *rest = log.read_text().splitlines()
    return json.loads(first), rest


def test_a_forked_process_is_what_python_dash_m_starts(parent_env: dict[str, str], tmp_path: Path) -> None:
    """The same argv, ``__name__``, environment, session, sys.path[0], signal dispositions and output
    buffering as a new interpreter started with ``subprocess`` (start_new_session, output to a file),
    the same exit status, and an end that joins its threads and runs ``atexit``; its command line and
    environment in /proc are the ones asked for."""
    fresh_log, forked_log = tmp_path / "fresh.log", tmp_path / "forked.log"
    with fresh_log.open("wb") as out:
        fresh = subprocess.Popen([*PROBE, "3"], env=parent_env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                 start_new_session=True)  # fmt: skip
    with forked_log.open("wb") as out:
        process = forked([*PROBE, "3", "1.0"], parent_env, cwd=str(REPO), stdout=out.fileno(), stderr=out.fileno())
    assert isinstance(process, ForkedProcess), "the service parent refused the probe"
    assert cmdline(process.pid).split(b"\0")[:-1] == [arg.encode() for arg in [*PROBE, "3", "1.0"]]
    assert environ(process.pid).get("TRAINJOBS_PROBE") == "from the request"
    assert process.poll() is None
    assert (fresh.wait(timeout=60), process.wait(timeout=60)) == (3, 3)
    seen_fresh, end_fresh = probe_output(fresh_log)
    seen_forked, end_forked = probe_output(forked_log)
    assert seen_forked["argv"][1:] == ["3", "1.0"] and seen_fresh["argv"][1:] == ["3"]
    for seen in (seen_fresh, seen_forked):
        seen["argv"] = seen["argv"][0]
    assert seen_forked == seen_fresh
    assert seen_forked["probe"] == "from the request" and seen_forked["session_leader"]
    assert end_forked == end_fresh == ["thread ended", "atexit ran"]


def test_ignored_signals_are_passed_on_and_a_signal_death_is_reported(
    parent_env: dict[str, str], tmp_path: Path
) -> None:
    """A requester that ignores SIGINT (a background job of a script) has its processes start with it
    ignored, as exec keeps it; a process killed by a signal reports it as ``Popen`` does (negative)."""
    log = tmp_path / "probe.log"
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with log.open("wb") as out:
            process = forked([*PROBE, "0", "60"], parent_env, cwd=str(REPO), stdout=out.fileno(), stderr=out.fileno())
    finally:
        signal.signal(signal.SIGINT, previous)
    assert process is not None
    deadline = time.monotonic() + 30
    while not log.read_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert probe_output(log)[0]["sigint"] == "ignored"
    process.send_signal(signal.SIGKILL)
    assert process.wait(timeout=30) == -signal.SIGKILL


def test_a_process_dies_with_its_requester_only_when_asked(parent_env: dict[str, str], tmp_path: Path) -> None:
    """``die_with_parent`` (worker/processes.py:spawn_child's children): the requester SIGKILLed, the
    process gets SIGTERM, as from ``PR_SET_PDEATHSIG``; without it, the process lives on."""
    script = (
        "import os, sys\n"
        "from worker.service_parent import forked\n"
        "probe = [sys.executable, '-m', 'tests.worker.service_probe', '0', '120']\n"
        "null = os.open(os.devnull, os.O_WRONLY)\n"
        "pids = [forked(probe, os.environ, stdout=null, stderr=null, die_with_parent=dies).pid for dies in (1, 0)]\n"
        "print(*pids, flush=True)\n"  # the ForkedProcess objects are dropped: that must change nothing
        "import time; time.sleep(600)\n"
    )
    requester = subprocess.Popen([sys.executable, "-c", script], env=parent_env, cwd=REPO, stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    assert requester.stdout is not None
    try:
        dying, living = (int(pid) for pid in requester.stdout.readline().split())
    except BaseException:
        requester.kill()
        raise
    try:
        time.sleep(0.5)  # long enough for a keeper to see a dropped connection
        assert is_alive(dying) and is_alive(living)
        requester.kill()
        requester.wait()
        deadline = time.monotonic() + 30
        while is_alive(dying) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not is_alive(dying), "the process outlived its requester"
        assert is_alive(living)
    finally:
        for pid in (dying, living):
            if is_alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_the_parent_refuses_what_it_could_not_start_as_python_would(
    parent_env: dict[str, str], tmp_path: Path
) -> None:
    """A variable read while importing set otherwise (the hub's cache, read by huggingface_hub as it
    imports), a folder holding modules of its own (first on sys.path), a command that is not
    ``python -m``: refused, and the caller starts the process itself."""
    assert forked([*PROBE, "0"], {**parent_env, "HF_HOME": str(tmp_path / "hub")}, cwd=str(REPO)) is None
    (tmp_path / "datasets.py").write_text("raise SystemExit('shadowed')\n")
    assert forked([*PROBE, "0"], parent_env, cwd=str(tmp_path)) is None
    assert forked([sys.executable, "-c", "pass"], parent_env, cwd=str(REPO)) is None
    # What the parent allows to differ (settings, read when a process runs) does not matter.
    changed = {**parent_env, "DATABASE_URL": "sqlite:///elsewhere.db", "TRAINJOBS_HOME": str(tmp_path)}
    with open(os.devnull, "wb") as null:
        process = forked([*PROBE, "0"], changed, cwd=str(REPO), stdout=null.fileno(), stderr=null.fileno())
    assert process is not None and process.wait(timeout=60) == 0


def test_a_requester_in_other_namespaces_is_refused(parent_env: dict[str, str]) -> None:
    """A requester on a fleet test's host (its own network and host name) starts its processes itself:
    the parent's imports cached this machine's host name (Celery's), which a process there must not see."""
    if why := netns_unavailable():
        pytest.skip(f"no network namespaces: {why}")
    script = (
        "import os, sys\n"
        "from worker.service_parent import forked\n"
        "print(forked([sys.executable, '-m', 'tests.worker.service_probe', '0'], os.environ, stdout=2))\n"
    )
    host = subprocess.run(["unshare", "--net", "--uts", sys.executable, "-c", script], env=parent_env, cwd=REPO,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert (host.returncode, host.stdout.strip()) == (0, "None"), host.stderr
    here = subprocess.run([sys.executable, "-c", script], env=parent_env, cwd=REPO, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert here.stdout.startswith("<worker.service_parent.ForkedProcess"), here.stderr  # the same script, here
