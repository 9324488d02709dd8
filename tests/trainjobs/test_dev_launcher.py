"""``trainjobs dev``: Ctrl-C stops the API, the worker and a running training; the next start finds the
job where it was (back in the queue from its checkpoint, or failed with a reason, never "running")
and finishes it.

(A job without a checkpoint is failed with the reason ``worker_lost``: tests/worker/test_recovery.py.)"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.trainer_core.datagen import write_sentiment_csv
from tests.trainjobs.conftest import job_spec
from tests.trainjobs.live import free_port, trainjobs_argv
from tests.trainjobs.test_readme_fresh_clone import processes_in
from trainjobs.client import Client

pytestmark = pytest.mark.slow
KEY = "tj_known-key-from-the-environment"


def start_dev(home: Path, port: int) -> subprocess.Popen[bytes]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_URL", "BROKER_URL", "ARTIFACTS_ROOT"))}
    env.update(TRAINJOBS_HOME=str(home), TRAINJOBS_API_KEY=KEY, TRAINJOBS_CANCEL_GRACE_SECONDS="10")
    log = (home.parent / "dev.log").open("ab")
    process = subprocess.Popen(trainjobs_argv(["dev", "--port", str(port)]), cwd=home.parent, env=env,
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


def interrupt(process: subprocess.Popen[bytes]) -> None:
    os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C in its terminal sends
    try:
        process.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise


def test_ctrl_c_then_restart_finishes_the_running_job(tmp_path: Path) -> None:
    home, port = tmp_path / "var", free_port()
    files = write_sentiment_csv(home / "data" / "reviews", n_train=96, n_val=16)
    # Long enough (360 tiny steps) that Ctrl-C lands mid-run however fast the machine is.
    training = {"num_train_epochs": 30, "save_steps": 2, "eval_strategy": "no"}
    spec: dict[str, Any] = job_spec(files, "interrupted", training=training)
    dev = start_dev(home, port)
    try:
        client = Client(f"http://127.0.0.1:{port}", KEY)  # the key from TRAINJOBS_API_KEY is the admin's
        job_id = client.submit(spec)["id"]
        events = client.events(job_id)
        next(e for e in events if e.event == "progress" and e.data["step"] >= 3)
        events.close()
    finally:
        interrupt(dev)
    assert processes_in(tmp_path) == [], "something outlived Ctrl-C"

    dev = start_dev(home, port)
    try:
        # It has a checkpoint (save_steps 2, stopped after step 3): back in the queue, not "running".
        assert client.get(job_id)["status"] in ("queued", "running")
        statuses = [e.data["status"] for e in client.events(job_id) if e.event == "status"]
        assert statuses[-1] == "succeeded"
        assert "queued" in statuses[1:], statuses  # it went back to the queue and ran again
        assert client.get(job_id)["attempts"] == 2
    finally:
        interrupt(dev)
    assert processes_in(tmp_path) == []
