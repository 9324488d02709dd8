"""Runs forked from a slot's pre-imported parent (worker/forkserver.py, worker/zygote.py): real runs
under the supervisor, the same results as a fresh interpreter, a clean process, and the slow path
whenever the warm one cannot be trusted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select, update

from service_core.db import Job, MetricPoint
from service_core.db.session import session_scope
from service_core.settings import Settings
from tests.fleet.netns import netns_unavailable
from tests.shared_servers import await_parents
from worker import forkserver
from worker.execute import execute_job
from worker.forkserver import (
    RUN_TIME_VARIABLES,
    ForkedRun,
    ForkServer,
    fork_server_pid,
    start_fork_server,
    start_run,
    zygote_from_parent,
)
from worker.lease import kill_own_runs
from worker.paths import run_paths
from worker.procfs import cmdline, environ, parent_of
from worker.run_env import run_environment

from .conftest import JobFactory, group_members, load_job, quick_spec
from .test_supervisor import start_in_thread, wait_for


@pytest.fixture(scope="module")
def warm(warm_runs: ForkServer) -> Iterator[ForkServer]:
    """This test process as a slot with its fork server, secrets in its environment as a worker has.

    The fork server is the suite's (tests/conftest.py:warm_runs), the one :func:`start_fork_server`
    returns here. A second zygote in this process would be one more child leading its own group with
    the run marker: ``kill_own_runs`` spares only the current fork server, so the fencing test below
    killed the suite's zygote as a run, and every later run of this test process started fresh."""
    saved = dict(os.environ)
    os.environ.update({"TRAINJOBS_SECRET_KEY": "slot-secret", "TRAINJOBS_API_KEY": "admin-key"})
    assert start_fork_server(run_environment(os.environ)) is warm_runs
    assert warm_runs.usable(run_environment(os.environ))  # the secrets are not in a run's environment
    try:
        yield warm_runs
    finally:
        os.environ.clear()
        os.environ.update(saved)


def losses(settings: Settings, job_id: str) -> list[float | None]:
    with session_scope(settings.database_url) as s:
        rows = s.execute(select(MetricPoint.value).where(MetricPoint.job_id == job_id, MetricPoint.name == "loss")
                         .order_by(MetricPoint.step)).scalars().all()  # fmt: skip
    return list(rows)


def quality(settings: Settings, job_id: str) -> dict[str, float]:
    """The final metrics that depend on the training alone (not on how fast it ran)."""
    metrics = load_job(settings, job_id).final_metrics or {}
    timed = ("runtime", "per_second")
    return {k: v for k, v in metrics.items() if not any(t in k for t in timed)}


def test_a_forked_run_trains_exactly_as_a_fresh_interpreter(
    warm: ForkServer, sqlite_settings: Settings, make_job: JobFactory, sentiment_files: dict[str, str]
) -> None:
    spec = quick_spec(sentiment_files)
    forked = make_job(sqlite_settings, spec)
    assert execute_job(forked, sqlite_settings) == "succeeded"
    forkserver._server = None  # the same slot without its fork server: a fresh interpreter
    try:
        fresh = make_job(sqlite_settings, spec)
        assert execute_job(fresh, sqlite_settings) == "succeeded"
    finally:
        forkserver._server = warm
    assert len(losses(sqlite_settings, forked)) == 8
    assert losses(sqlite_settings, forked) == losses(sqlite_settings, fresh)
    assert quality(sqlite_settings, forked) == quality(sqlite_settings, fresh)


def test_a_forked_run_is_a_clean_process_and_cancel_stops_its_group(
    warm: ForkServer, sqlite_settings: Settings, make_job: JobFactory, sentiment_files: dict[str, str]
) -> None:
    job_id = make_job(sqlite_settings, quick_spec(sentiment_files, num_train_epochs=200, dataloader_num_workers=1))
    thread, result = start_in_thread(job_id, sqlite_settings)
    wait_for(lambda: load_job(sqlite_settings, job_id).progress_step >= 2, 90, "the run to make progress")
    pid = int(run_paths(job_id, sqlite_settings).pid_file.read_text())
    assert parent_of(pid) == fork_server_pid() == warm.proc.pid  # forked, not a fresh interpreter
    assert os.getsid(pid) == pid and os.getpgid(pid) == pid  # a session and group of its own
    env = environ(pid)
    assert "TRAINJOBS_SECRET_KEY" not in env and "TRAINJOBS_API_KEY" not in env
    assert env["PYTHONUNBUFFERED"] == "1" and env["HF_HUB_OFFLINE"] == "1"
    wait_for(lambda: len(group_members(pid)) >= 2, 30, "the dataloader worker to start")
    with session_scope(sqlite_settings.database_url) as s:
        s.execute(update(Job).where(Job.id == job_id).values(cancel_requested=True))
    thread.join(60)
    assert result["status"] == "cancelled"
    assert group_members(pid) == []
    assert warm.proc.poll() is None  # the fork server lives on for the next run


def blocked_run_args(tmp_path: Path) -> list[str]:
    """Arguments of a run that blocks reading its spec (a FIFO nobody writes): alive until killed."""
    spec = tmp_path / "spec.json"
    os.mkfifo(spec)
    return [str(spec), "--output-dir", str(tmp_path / "out")]


def test_a_forked_run_leads_its_own_group_as_soon_as_its_pid_is_known(warm: ForkServer, tmp_path: Path) -> None:
    # The slot may signal the run's group (cancel, fencing) the moment start_run returns; a child
    # that had not yet called setsid was still in the fork server's group, and a fencing sweep missed it.
    runs = []
    try:
        with (tmp_path / "log").open("ab") as log:
            for i in range(10):
                (tmp_path / str(i)).mkdir()
                run = start_run(blocked_run_args(tmp_path / str(i)), run_environment(os.environ), log)
                runs.append(run)
                assert isinstance(run, ForkedRun)
                assert os.getsid(run.pid) == os.getpgid(run.pid) == run.pid
    finally:
        for run in runs:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait(timeout=30)
    assert warm.proc.poll() is None


def test_a_fenced_out_slot_kills_its_forked_run_but_not_the_fork_server(warm: ForkServer, tmp_path: Path) -> None:
    with (tmp_path / "log").open("ab") as log:
        run = start_run(["--help"], run_environment(os.environ), log)
        assert isinstance(run, ForkedRun)
        assert run.wait(timeout=60) == 0  # argparse's --help: the engine's main ran in the child
        run = start_run(blocked_run_args(tmp_path), run_environment(os.environ), log)
    assert isinstance(run, ForkedRun)
    try:
        assert run.pid in kill_own_runs()
        assert run.wait(timeout=30) == -signal.SIGKILL
    finally:
        if run.poll() is None:
            os.kill(run.pid, signal.SIGKILL)
    assert warm.proc.poll() is None


def test_another_run_environment_starts_a_fresh_interpreter(warm: ForkServer, tmp_path: Path) -> None:
    env = {**warm.env, "TRAINJOBS_FAULT_SOMETHING": "1"}
    with (tmp_path / "log").open("ab") as log:
        run = start_run(["--help"], env, log)
    assert isinstance(run, subprocess.Popen)
    assert run.wait(timeout=120) == 0


def test_the_oom_testing_aid_is_a_run_time_variable() -> None:
    # worker.forkserver names it without importing trainer_core (torch): the two names must agree.
    from trainer_core.oom_fault import FAULT_OOM_ENV

    assert FAULT_OOM_ENV in RUN_TIME_VARIABLES


@pytest.mark.parametrize("variable", sorted(RUN_TIME_VARIABLES))
def test_a_run_setting_a_variable_read_at_run_time_is_still_forked(
    warm: ForkServer, tmp_path: Path, variable: str
) -> None:
    # A node of a multi-node job names gloo's interface (worker/gang.py:run_env), read only as the
    # process group forms; the OOM testing aid is read as training starts: the zygote, which imported
    # without them, still forks the run. (That the run has them, the fleet's two-node jobs show: over
    # the hosts' veth links, gloo needs it; and tests/worker/test_oom_retry.py's runs meet the fault.)
    env = {**warm.env, variable: "1"}
    with (tmp_path / "log").open("ab") as log:
        run = start_run(blocked_run_args(tmp_path), env, log)
    try:
        assert isinstance(run, ForkedRun)
    finally:
        os.killpg(run.pid, signal.SIGKILL)
        run.wait(timeout=30)


def test_a_dead_fork_server_loses_no_run_and_later_runs_start_fresh(tmp_path: Path) -> None:
    env = run_environment(os.environ)
    server = ForkServer(env)
    saved, forkserver._server = forkserver._server, server
    try:
        assert server.usable(env)
        with (tmp_path / "log").open("ab") as log:
            run = server.launch(["--help"], env, log.fileno())
            run.wait(timeout=60)
            run = server.launch(blocked_run_args(tmp_path), env, log.fileno())
            server.proc.kill()  # the zygote dies with a run outstanding
            server.proc.wait()
            assert run.poll() is None  # the orphaned run is still there: no status made up for it
            os.kill(run.pid, signal.SIGKILL)
            assert run.wait(timeout=30) == -signal.SIGKILL  # gone unreported: counted as killed
            assert not server.usable(env)  # seen dead before a launch is tried
            fresh = start_run(["--help"], env, log)
        assert isinstance(fresh, subprocess.Popen)
        assert fresh.wait(timeout=120) == 0
    finally:
        forkserver._server = saved
        server.close()


def test_the_fork_server_ends_with_its_slot(tmp_path: Path) -> None:
    # A stand-in slot: starts a fork server, reports its pid, then is SIGKILLed.
    script = (
        "import os, sys\n"
        "from worker.forkserver import start_fork_server\n"
        "from worker.run_env import run_environment\n"
        "server = start_fork_server(run_environment(os.environ))\n"
        "print(server.proc.pid, server.usable(run_environment(os.environ)), flush=True)\n"
        "import time; time.sleep(600)\n"
    )
    slot = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    assert slot.stdout is not None
    pid, ready = slot.stdout.readline().split()
    assert ready == "True"
    assert group_members(int(pid)) == [int(pid)]
    slot.kill()
    slot.wait()
    wait_for(lambda: group_members(int(pid)) == [], 20, "the fork server to end after its slot")


@pytest.fixture
def zygote_parent() -> str:
    """The suite's zygote parent's socket, once it listens."""
    path = await_parents()
    assert path is not None and Path(path).exists(), f"no zygote parent listening at {path}"
    return path


def test_a_slot_gets_its_zygote_from_the_parent_imported_and_it_ends_with_the_slot(zygote_parent: str) -> None:
    """``TRAINJOBS_ZYGOTE_PARENT`` (a testing aid; the suite's parent is tests/shared_servers.py's): the
    slot's zygote is forked by the parent, ready at once, in a session of its own; it forks the slot's
    runs, and ends when the slot does, as a zygote the slot started would."""
    script = (
        "import os, sys\n"
        "from worker.forkserver import start_fork_server\n"
        "from worker.run_env import run_environment\n"
        "env = run_environment(os.environ)\n"
        "server = start_fork_server(env, os.environ['TRAINJOBS_ZYGOTE_PARENT'])\n"
        "ready = server.ready\n"  # before any wait: a zygote the slot started would still be importing
        "run = server.launch(['--help'], env, sys.stderr.fileno())\n"
        "print(server.proc.pid, ready, run.wait(timeout=60), run.stdout.read().startswith('usage'), flush=True)\n"
        "import time; time.sleep(600)\n"
    )
    slot = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    assert slot.stdout is not None
    pid, ready, code, usage = slot.stdout.readline().split()
    assert (ready, code, usage) == ("True", "0", "True")
    assert b"--parent" in cmdline(parent_of(int(pid)) or 0)  # forked there, not started by the slot
    assert group_members(int(pid)) == [int(pid)]
    slot.kill()
    slot.wait()
    wait_for(lambda: group_members(int(pid)) == [], 20, "the handed zygote to end after its slot")


def test_the_parent_refuses_a_slot_whose_zygote_would_import_otherwise(zygote_parent: str, tmp_path: Path) -> None:
    """A zygote the slot started would have imported under another environment, or from a folder that
    holds modules (first on its sys.path): the slot imports its own, whose runs see what they would in
    production. A folder that holds none changes nothing (the dev launcher runs in its home's folder)."""
    assert zygote_from_parent(zygote_parent, {**run_environment(os.environ), "OMP_NUM_THREADS": "2"}) is None
    handed = zygote_from_parent(zygote_parent, run_environment(os.environ))  # the same slot, its own environment
    assert handed is not None
    handed[0].close()  # the zygote ends with its slot's end of the socket
    script = (
        "import os\n"
        "from worker.forkserver import zygote_from_parent\n"
        "from worker.run_env import run_environment\n"
        "print(zygote_from_parent(os.environ['TRAINJOBS_ZYGOTE_PARENT'], run_environment(os.environ)) is not None)\n"
    )
    (tmp_path / "var").mkdir()  # data, not a module
    empty = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert empty.stdout.strip() == "True", empty.stderr
    (tmp_path / "datasets.py").write_text("raise SystemExit('shadowed')\n")
    shadowing = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert shadowing.stdout.strip() == "False", shadowing.stderr


def test_a_zygote_from_the_parent_joins_its_slots_namespaces(zygote_parent: str) -> None:
    """A slot in other namespaces (a fleet host's, tests/fleet: its own network and hostname) gets a
    zygote that has joined them, so the runs it forks live on that host."""
    if why := netns_unavailable():
        pytest.skip(f"no network namespaces: {why}")
    script = (
        "import os, socket\n"
        "from worker.forkserver import zygote_from_parent\n"
        "from worker.run_env import run_environment\n"
        "sock, zygote = zygote_from_parent(os.environ['TRAINJOBS_ZYGOTE_PARENT'], run_environment(os.environ))\n"
        "pids = (os.getpid(), zygote.pid)\n"
        "print(*(os.readlink(f'/proc/{pid}/ns/{space}') for pid in pids for space in ('net', 'uts')))\n"
    )
    host = subprocess.run(["unshare", "--net", "--uts", sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert host.returncode == 0, host.stderr
    slot_net, slot_uts, zygote_net, zygote_uts = host.stdout.split()
    assert (zygote_net, zygote_uts) == (slot_net, slot_uts)
    assert slot_net != os.readlink("/proc/self/ns/net")  # the slot was elsewhere, and so is its zygote


def test_the_suites_zygote_still_serves_runs_once_a_dataset_was_loaded_here(
    warm_runs: ForkServer, sentiment_files: dict[str, str], tmp_path: Path
) -> None:
    """The runs the tests start fork from the suite's zygote (tests/conftest.py:warm_runs) only while
    this process's run environment equals the zygote's, and it lives. A library that writes to
    os.environ on import would silently send every later run to a fresh interpreter: loading a dataset
    imports threadpoolctl, which sets KMP_DUPLICATE_LIB_OK; building a model imports torch._dynamo,
    which sets TORCHINDUCTOR_CACHE_DIR."""
    import torch._dynamo  # noqa: F401
    from datasets import load_dataset

    load_dataset("csv", data_files=sentiment_files["train"], cache_dir=str(tmp_path / "cache"))
    env = run_environment(os.environ)
    assert warm_runs.differences(env) == set()
    assert warm_runs.usable(env)
