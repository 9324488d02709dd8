"""A server installed from the package, not run from the checkout: the wheel is built, installed with its
[server] extra into a fresh venv, and every command runs from a folder outside the checkout, so nothing
imports from the source tree. ``trainjobs migrate`` creates the schema (SQLite and PostgreSQL),
``trainjobs serve`` and ``trainjobs worker`` refuse a database it has not migrated, in one line with
exit code 2, and ``trainjobs dev --example`` works in an empty folder.

pip keeps no cache on this machine, so the [server] dependencies are kept as wheels in
``~/.cache/trainjobs-tests/wheels``: the install is offline from there, and only a missing wheel sends
pip to the index (the first run, or after a dependency changed).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from service_core.migrations import head_revision
from tests.trainjobs.live import REPO, free_port
from tests.trainjobs.test_serving import wait_until
from tests.worker.conftest import create_pg_database, drop_pg_database

pytestmark = pytest.mark.slow
WHEELHOUSE = Path.home() / ".cache" / "trainjobs-tests" / "wheels"
SOURCES = ("pyproject.toml", "README.md", "trainer_core", "service_core", "api", "worker", "trainjobs")
HINT = "run `trainjobs migrate`"


def pip_install(python: Path, requirement: str) -> None:
    """Install ``requirement`` into ``python``'s venv from the wheelhouse, filling it first if needed."""
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-index",
               "--find-links", str(WHEELHOUSE), requirement]  # fmt: skip
    if subprocess.run(install, capture_output=True).returncode == 0:
        return
    WHEELHOUSE.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "-w", str(WHEELHOUSE), requirement], check=True,
                   capture_output=True, timeout=900)  # fmt: skip
    for own in WHEELHOUSE.glob("trainjobs-*.whl"):  # the wheel under test is named by its path, never cached
        own.unlink()
    subprocess.run(install, check=True, capture_output=True)


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv outside the checkout with ``trainjobs[server]`` installed from a wheel of this tree."""
    root = tmp_path_factory.mktemp("package")
    source = root / "source"  # a copy: setuptools' build/ folder in the checkout may hold stale modules
    source.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(root / "dist"), str(source)], check=True, capture_output=True)  # fmt: skip
    (wheel,) = (root / "dist").glob("trainjobs-*.whl")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    pip_install(venv / "bin" / "python", f"{wheel}[server]")
    shutil.rmtree(source)
    return venv


def clean_env(home: Path, **extra: str) -> dict[str, str]:
    drop = ("TRAINJOBS_", "DATABASE_URL", "BROKER_URL", "ARTIFACTS_ROOT", "DATA_ROOT", "PYTHONPATH", "AWS_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    return {**env, "TRAINJOBS_HOME": str(home), "TRAINJOBS_PREWARM_RUNS": "false", **extra}


def trainjobs(venv: Path, args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(venv / "bin" / "trainjobs"), *args], env=env, cwd=cwd, capture_output=True,
                          text=True, timeout=120)  # fmt: skip


def assert_refused(result: subprocess.CompletedProcess[str], expected: str) -> None:
    """Exit 2 and exactly one line, no traceback."""
    assert result.returncode == 2, result.stderr
    assert result.stderr == f"error: {expected}\n", result.stderr


def ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/readyz", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def wait_ready(process: subprocess.Popen[bytes], url: str) -> None:
    wait_until(lambda: process.poll() is not None or ready(url), 90, f"{url}/readyz")
    assert process.poll() is None, f"exited with {process.returncode}"


def stop(process: subprocess.Popen[bytes], sig: int = signal.SIGTERM, log: Path | None = None) -> int:
    os.killpg(process.pid, sig)
    try:
        return process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        tail = log.read_text(errors="replace")[-4000:] if log is not None and log.is_file() else "(no log)"
        raise AssertionError(f"still running 60 s after signal {sig}; its log ends:\n{tail}") from None


def migrate_then_serve(venv: Path, env: dict[str, str], cwd: Path, shown_url: str, missing: str) -> None:
    """Both refusals, the migration (twice: the second has nothing to do), then an API that is ready."""
    assert_refused(trainjobs(venv, ["serve", "--port", "1"], env, cwd), f"database {shown_url} {missing}")
    assert_refused(trainjobs(venv, ["worker"], env, cwd), f"database {shown_url} {missing}")
    head = head_revision()
    migrated = trainjobs(venv, ["migrate"], env, cwd)
    assert migrated.returncode == 0, migrated.stderr
    assert migrated.stdout == f"migrated {shown_url} from an empty database to revision {head} (head)\n"
    again = trainjobs(venv, ["migrate"], env, cwd)
    assert again.stdout == f"{shown_url} is at revision {head} (head): nothing to do\n", again.stderr

    port = free_port()
    api = subprocess.Popen([str(venv / "bin" / "trainjobs"), "serve", "--host", "127.0.0.1", "--port", str(port)],
                           env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           start_new_session=True)  # fmt: skip
    try:
        wait_ready(api, f"http://127.0.0.1:{port}")
    finally:
        stop(api)


def test_the_package_carries_everything_and_imports_nothing_from_the_checkout(venv: Path, tmp_path: Path) -> None:
    code = ("import api, service_core.migrations as m, trainjobs.launcher as l; "
            "print(api.__file__, m.head_revision(), l.EXAMPLES_DIR)")  # fmt: skip
    shown = subprocess.run([str(venv / "bin" / "python"), "-c", code], cwd=tmp_path, env=clean_env(tmp_path),
                           capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    assert all(Path(p).is_relative_to(venv) for p in (shown[0], shown[2])), shown
    assert shown[1] == head_revision()
    assert not (Path(shown[2]).parents[1] / "alembic.ini").exists()


def test_migrate_and_serve_on_sqlite(venv: Path, tmp_path: Path) -> None:
    home = tmp_path / "var"
    url = f"sqlite:///{(home / 'trainjobs.db').resolve()}"
    migrate_then_serve(venv, clean_env(home), tmp_path, url, f"does not exist: {HINT}")


@pytest.fixture
def fresh_pg_url() -> Iterator[str]:
    name, url = create_pg_database("trainjobs_pkg")
    try:
        yield url
    finally:
        drop_pg_database(name)


@pytest.mark.postgres
def test_migrate_and_serve_on_postgres_never_showing_the_password(
    venv: Path, tmp_path: Path, fresh_pg_url: str
) -> None:
    # The server trusts local connections, so any password gets in; it must never be printed.
    password = f"pw-{secrets.token_hex(6)}"
    url = fresh_pg_url.replace("//postgres@", f"//postgres:{password}@")
    env = clean_env(tmp_path / "var", DATABASE_URL=url)
    migrate_then_serve(venv, env, tmp_path, url.replace(password, "***"), f"has no trainjobs schema yet: {HINT}")


def test_dev_example_in_an_empty_folder(venv: Path, tmp_path: Path) -> None:
    port = free_port()
    log = tmp_path / "dev.log"
    with log.open("wb") as out:
        dev = subprocess.Popen([str(venv / "bin" / "trainjobs"), "dev", "--example", "--port", str(port)],
                               env=clean_env(Path("var")), cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT,
                               start_new_session=True)  # fmt: skip
    try:
        wait_ready(dev, f"http://127.0.0.1:{port}")
        spec = (tmp_path / "var" / "example-job.json").read_text()
    finally:
        assert stop(dev, signal.SIGINT, log) == 0, log.read_text()[-3000:]
    # No packaged MiniLM in a [server] install: the example names the model on the hub.
    assert '"name_or_path": "sentence-transformers/all-MiniLM-L6-v2"' in spec
    assert str(tmp_path / "var" / "data" / "examples") in spec


def test_a_worker_imports_without_the_training_extra() -> None:
    """A [server] install has no torch, accelerate, transformers, datasets or peft: a run needs them, the
    worker's main process (which hands jobs to runs) must start without them. `trainjobs dev` from such
    an install lost its worker when the OOM retry imported the memory planner at module level."""
    script = ("import sys; sys.modules.update(torch=None, accelerate=None, transformers=None, datasets=None, "
              "peft=None); import worker.main, worker.tasks, worker.celery_app")  # fmt: skip
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
