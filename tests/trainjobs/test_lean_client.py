"""The lean client: ``pip install trainjobs`` (no extras) runs the Python client and the remote commands
without torch, the server's database layer or Celery.

The fast test runs the remote code paths in a subprocess and lists what they imported; the slow one
installs this checkout into a fresh virtual environment with no extras and drives a live service
with the ``trainjobs`` it installed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from service_core.status import JobStatus
from tests.trainjobs.conftest import job_spec, write_json
from tests.trainjobs.live import REPO, LiveService

# What only the [server] and [train] extras bring; none of it may load on the client's paths.
SERVER_OR_ENGINE = {
    "torch", "transformers", "accelerate", "datasets", "numpy", "sqlalchemy", "alembic", "psycopg",
    "celery", "kombu", "redis", "fastapi", "uvicorn", "pydantic_settings",
}  # fmt: skip
# What `pip install .` needs from the checkout (the packages pyproject.toml lists, and its readme).
PROJECT_FILES = ["pyproject.toml", "README.md", "trainer_core", "service_core", "api", "worker", "trainjobs"]


def test_client_and_remote_commands_load_no_server_or_engine_module(tmp_path: Path) -> None:
    spec = write_json(tmp_path / "job.json", {"name": "lean"})
    script = textwrap.dedent(f"""
        import json, sys
        import trainjobs.client, trainjobs.follow
        from trainjobs.cli import build_parser, main
        loaded = lambda: sorted({{m.split(".")[0] for m in sys.modules}})
        nowhere = ["--url", "http://127.0.0.1:9"]  # refused at once: the code paths run, no service needed
        codes = [main(["jobs", "list", *nowhere]), main(["submit", {str(spec)!r}, *nowhere]),
                 main(["datasets", "list", *nowhere]), main(["estimate", {str(spec)!r}, "--remote", *nowhere])]
        remote = loaded()
        build_parser()  # every command group, as `trainjobs --help` registers them
        print(json.dumps({{"codes": codes, "remote": remote, "help": loaded()}}))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=REPO)

    report = json.loads(result.stdout.splitlines()[-1])
    assert report["codes"] == [2, 2, 2, 2], result.stderr  # each reached the network and reported it
    assert result.stderr.count("cannot reach http://127.0.0.1:9") == 4, result.stderr
    assert "trainjobs" in report["remote"] and "httpx" in report["remote"]
    # The remote paths do not even load the engine's package; the help only its spec (pydantic, yaml).
    heavy_on_remote = (SERVER_OR_ENGINE | {"trainer_core"}) & set(report["remote"])
    assert not heavy_on_remote, f"the remote commands loaded {sorted(heavy_on_remote)}"
    heavy_on_help = SERVER_OR_ENGINE & set(report["help"])
    assert not heavy_on_help, f"registering every command loaded {sorted(heavy_on_help)}"


def lean_install(target: Path) -> Path:
    """A fresh venv holding this checkout installed with no extras; returns its ``bin``."""
    source = target / "src"
    for name in PROJECT_FILES:
        path = REPO / name
        if path.is_dir():  # a copy, so the build's egg-info and build/ stay out of the checkout
            shutil.copytree(path, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            source.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, source / name)
    venv = target / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, str(source)], check=True, capture_output=True, text=True)
    return venv / "bin"


@pytest.mark.slow
def test_base_install_lists_and_submits_jobs_on_a_live_service(
    service: LiveService, sentiment_files: dict[str, str], tmp_path: Path
) -> None:
    bin_dir = lean_install(tmp_path / "lean")
    installed = subprocess.run([str(bin_dir / "python"), "-m", "pip", "list", "--format=json"],
                               check=True, capture_output=True, text=True).stdout  # fmt: skip
    names = {p["name"].lower() for p in json.loads(installed)}
    assert "trainjobs" in names and names.isdisjoint({"torch", "sqlalchemy", "celery", "fastapi"}), names

    spec = write_json(tmp_path / "job.json", job_spec(sentiment_files, "from-the-lean-client"))
    # Not PYTHONPATH: the installed copy runs, from a folder that is not the checkout.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"TRAINJOBS_URL": service.url, "TRAINJOBS_API_KEY": service.key}

    def lean(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(bin_dir / "trainjobs"), *args], env=env, cwd=tmp_path, capture_output=True,
                              text=True, timeout=60)  # fmt: skip

    # To a queue no worker serves: the job is still there to list and cancel (a tiny job on the shared
    # service's idle worker can finish between two commands).
    submitted = lean("submit", str(spec), "--queue", "lean-client-nobody-serves-this")
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.split()[0]
    listed = lean("jobs", "list")
    assert listed.returncode == 0, listed.stderr
    line = next(row for row in listed.stdout.splitlines() if row.startswith(job_id))
    assert line.split()[1] in set(JobStatus) and line.endswith("from-the-lean-client")
    cancelled = lean("jobs", "cancel", job_id)
    assert cancelled.returncode == 0 and f"cancel requested for {job_id}" in cancelled.stderr
    # The service's estimate, rendered by the client without torch as `trainjobs estimate` renders it.
    estimated = lean("estimate", str(spec), "--remote")
    assert estimated.returncode == 0, estimated.stderr
    assert "total per device" in estimated.stdout and "max(activations" in estimated.stdout
    assert "Traceback" not in submitted.stderr + listed.stderr + cancelled.stderr + estimated.stderr

    # The server and engine commands are listed, and say which extra they need instead of a traceback.
    helped = lean("--help")
    assert helped.returncode == 0 and "serve" in helped.stdout and "train" in helped.stdout
    train = ["train", str(spec), "--output-dir", "out"]
    for args, extra in ((["serve"], "server"), (["estimate", str(spec)], "train"), (train, "train")):
        refused = lean(*args)
        assert refused.returncode == 2 and f"pip install 'trainjobs[{extra}]'" in refused.stderr, refused.stderr
        assert "Traceback" not in refused.stderr
