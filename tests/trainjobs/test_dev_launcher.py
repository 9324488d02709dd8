"""``trainjobs dev``: Ctrl-C stops the API, the worker and a running training; the next start finds the
job where it was (back in the queue from the checkpoint its stop wrote, never "running") and finishes
it from there, every step trained once.

(A job without a checkpoint starts over from step 0 while it has restarts left, else fails with the
reason ``worker_lost``: tests/worker/test_recovery.py.)"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from service_core.runs import run_work_dir
from service_core.status import ErrorReason
from tests.run_holds import hold_until_asked_to_stop
from tests.trainer_core.datagen import write_sentiment_csv
from tests.trainjobs.conftest import job_spec
from tests.trainjobs.live import LiveService, free_port, trainjobs_argv
from tests.trainjobs.test_readme_fresh_clone import processes_in
from tests.trainjobs.test_serving import wait_until
from trainjobs.client import Client
from worker.paths import WORKER_NAME_ENV
from worker.procfs import all_processes, cmdline, environ, is_alive

pytestmark = pytest.mark.slow
KEY = "tj_known-key-from-the-environment"


@contextmanager
def sigint_ignored() -> Iterator[None]:
    """Start children the way a non-interactive shell starts a background job (``trainjobs dev &``,
    ``make test &``): with SIGINT ignored, a disposition they keep across exec."""
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def start_dev(home: Path, port: int, *options: str) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_URL", "BROKER_URL", "ARTIFACTS_ROOT"))}
    env.update(TRAINJOBS_HOME=str(home), TRAINJOBS_API_KEY=KEY, TRAINJOBS_CANCEL_GRACE_SECONDS="10")
    log = (home.parent / "dev.log").open("ab")
    with sigint_ignored():  # the Ctrl-C below must stop it all the same
        process = subprocess.Popen(trainjobs_argv(["dev", "--port", str(port), *options]), cwd=home.parent, env=env,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert process.poll() is None, (home.parent / "dev.log").read_text()[-3000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                return process
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise TimeoutError("trainjobs dev did not come up")


def interrupt(process: subprocess.Popen[bytes], sig: signal.Signals = signal.SIGINT, timeout: float = 120) -> None:
    """Send ``sig`` (by default what Ctrl-C in its terminal sends) and expect a clean exit in time."""
    os.killpg(process.pid, sig)
    try:
        assert process.wait(timeout=timeout) == 0, f"exit status {process.returncode} after {sig.name}"
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise


def test_ctrl_c_then_restart_finishes_the_running_job(tmp_path: Path) -> None:
    home, port = tmp_path / "var", free_port()
    files = write_sentiment_csv(home / "data" / "reviews", n_train=96, n_val=16)
    # 300 tiny steps, held once the third is seen until Ctrl-C reaches the run (tests/run_holds.py): on a
    # quiet machine they take under two seconds, and Ctrl-C took longer to reach it through the launcher,
    # the worker and the slot. No periodic checkpoint (save_steps stays 500): the one the run writes as
    # Ctrl-C stops it is what it resumes from.
    training = {"num_train_epochs": 50, "eval_strategy": "no"}
    spec: dict[str, Any] = job_spec(files, "interrupted", training=training)
    dev = start_dev(home, port)
    try:
        client = Client(f"http://127.0.0.1:{port}", KEY)  # the key from TRAINJOBS_API_KEY is the admin's
        job_id = client.submit(spec)["id"]
        events = client.events(job_id)
        next(e for e in events if e.event == "progress" and e.data["step"] >= 3)
        events.close()
        hold_until_asked_to_stop(run_work_dir(home, job_id))
    finally:
        interrupt(dev)
    assert processes_in(tmp_path) == [], "something outlived Ctrl-C"

    dev = start_dev(home, port)
    try:
        # It has the checkpoint its stop wrote: back in the queue, not "running".
        assert client.get(job_id)["status"] in ("queued", "running")
        changes = [e.data for e in client.events(job_id) if e.event == "status"]
        statuses = [data["status"] for data in changes]
        assert statuses == ["running", "queued", "running", "succeeded"], statuses
        requeue = changes[1]
        assert requeue["reason"] == ErrorReason.shutdown_requeue, requeue
        assert "from checkpoint-" in requeue["message"], requeue  # not from the start
        job = client.get(job_id)
        total = job["progress"]["total"]
        assert (job["attempts"], job["progress"]["step"], total) == (2, total, 300)  # 50 epochs x 6 steps
        # Resumed from the checkpoint: every logged step once, none twice.
        steps = [p["step"] for p in client.metrics(job_id, name="loss")]
        assert steps == list(range(2, total + 1, 2))
    finally:
        interrupt(dev)
    assert processes_in(tmp_path) == []


def test_serve_and_worker_stop_cleanly_on_stop_signals_whatever_they_inherited(tmp_path: Path) -> None:
    """``trainjobs serve`` and ``trainjobs worker`` started with SIGINT ignored stop on Ctrl-C, and the
    API as gracefully on SIGHUP (a closed terminal), which uvicorn itself does not handle."""
    service = LiveService(tmp_path / "home")
    try:
        with sigint_ignored():
            service.start()
        assert service.api is not None and service.worker is not None
        worker = service.worker.pid
        # Its slot started: the worker is past its own start (no need to wait for the slot's imports). A
        # slot is known by the name it has of its worker (worker/main.py:slot_command), not as its child:
        # the suite's service parent forks it (worker/service_parent.py).
        def slots_of_worker() -> list[int]:
            return [p.pid for p in all_processes() if f"-{worker}@%h".encode() in cmdline(p.pid)]

        wait_until(slots_of_worker, 60, "the worker's slot")
        slots = slots_of_worker()
        # And a slot knows its worker by the name the worker passes it (a gang's member records it).
        assert {environ(slot).get(WORKER_NAME_ENV) for slot in slots} == {f"{socket.gethostname()}-{worker}"}
        for process in (service.worker, service.api):
            interrupt(process, timeout=30)
        assert not any(map(is_alive, slots)), "a slot outlived its worker"
        with sigint_ignored():
            service.start_api()
        interrupt(service.api, signal.SIGHUP, timeout=30)
        assert (service.logs / "api.log").read_text().count("Application shutdown complete") == 2
    finally:
        service.stop()


def test_dev_s3_runs_the_service_on_its_own_seaweedfs_and_stops_it(tmp_path: Path) -> None:
    import json

    import fsspec
    import psutil

    home, port = tmp_path / "var", free_port()
    home.mkdir()
    dev = start_dev(home, port, "--s3")
    try:
        wait_until(lambda: "Press Ctrl-C" in (tmp_path / "dev.log").read_text(), 30, "the banner (worker started)")
        banner = (tmp_path / "dev.log").read_text()
        (endpoint,) = re.findall(r"Object store \(S3\): +(http://\S+)", banner)
        (identity,) = json.loads((home / "seaweedfs" / "s3.json").read_text())["identities"]
        (keys,) = identity["credentials"]
        assert keys["secretKey"] not in banner  # the keys stay in the file, never on the terminal
        store = fsspec.filesystem("s3", key=keys["accessKey"], secret=keys["secretKey"], skip_instance_cache=True,
                                  client_kwargs={"endpoint_url": endpoint, "region_name": "us-east-1"})  # fmt: skip
        store.pipe("trainjobs/artifacts/probe.txt", b"served")
        assert store.cat("trainjobs/artifacts/probe.txt") == b"served"
        # The API and the worker it started run on that store, with its keys (found by their home: the
        # suite's service parent, not the launcher, is their parent: worker/service_parent.py).
        children = [p.info for p in psutil.process_iter(["pid", "cmdline", "environ"])
                    if "trainjobs.cli" in (p.info["cmdline"] or []) and p.info["pid"] != dev.pid
                    and (p.info["environ"] or {}).get("TRAINJOBS_HOME") == str(home)]  # fmt: skip
        assert sorted(p["cmdline"][3] for p in children) == ["serve", "worker"]
        for env in (p["environ"] for p in children):
            assert (env["ARTIFACTS_ROOT"], env["DATA_ROOT"]) == ("s3://trainjobs/artifacts", "s3://trainjobs/data")
            assert (env["AWS_ENDPOINT_URL"], env["AWS_ACCESS_KEY_ID"]) == (endpoint, keys["accessKey"])
            assert env["AWS_SECRET_ACCESS_KEY"] == keys["secretKey"]
    finally:
        interrupt(dev)
    assert dev.returncode == 0
    assert processes_in(tmp_path) == [], "something outlived Ctrl-C"
    with pytest.raises(httpx.TransportError):
        httpx.get(endpoint, timeout=2)
