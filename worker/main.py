"""Start a worker: one Celery slot per GPU (or one on the CPU), and the periodic sweep.

Each slot is a ``celery -A worker.celery_app worker`` process with the solo pool (one job at a time;
the job itself runs in its own process group anyway) and ``CUDA_VISIBLE_DEVICES`` set to its GPU.
Slots get the settings through the environment, so a slot sees exactly what ``run_worker`` was given.
Slots run in their own sessions: a Ctrl-C reaches only this process, which then asks every slot for a
warm shutdown (their running jobs checkpoint and go back to the queue) and waits for them.
Meanwhile this process writes the worker's heartbeat row and sweeps (worker/sweeper.py): jobs of lost
workers go back to the queue, lost queue messages are sent again; and a thread of it sends webhook
deliveries (worker/webhook_sender.py).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence
from types import FrameType

from sqlalchemy import make_url

from service_core.settings import Settings, get_settings
from worker.celery_app import declare_queues
from worker.paths import WORKER_NAME_ENV, process_name
from worker.processes import ChildProcess, on_stop_signals, spawn_child, stop_processes
from worker.sweeper import Sweeper, sweep
from worker.webhook_sender import WebhookSender

log = logging.getLogger(__name__)


def settings_env(settings: Settings) -> dict[str, str]:
    """The environment variables that reproduce ``settings`` in a child process."""
    env: dict[str, str] = {}
    for name, info in Settings.model_fields.items():
        alias = info.validation_alias
        value = getattr(settings, name)
        if not isinstance(alias, str) or value is None:
            continue
        env[alias] = json.dumps(value) if isinstance(value, dict | list) else str(value)
    return env


def slot_command(queues: Sequence[str], name: str, loglevel: str = "INFO") -> list[str]:
    """The command line of one slot: a solo-pool Celery worker consuming ``queues``."""
    return [
        sys.executable, "-m", "celery", "-A", "worker.celery_app", "worker",
        "--queues", ",".join(queues), "--pool", "solo", "--concurrency", "1",
        "--hostname", f"{name}-{os.getpid()}@%h", "--loglevel", loglevel,
        "--without-gossip", "--without-mingle", "--without-heartbeat",
    ]  # fmt: skip


def slot_database_url(settings: Settings) -> str:
    """The slots' database URL: on PostgreSQL, the server ends a slot's transaction idle for a lease.

    A slot frozen inside a transaction (SIGSTOP, a paused VM) would otherwise keep its job row locked
    until TCP gives up, hours later, and the sweep could not requeue the job. A slot's transactions
    last milliseconds. (SQLite has no such remedy: a process frozen while it writes holds the file.)
    """
    url = make_url(settings.database_url)
    if url.get_backend_name() != "postgresql" or "options" in url.query:
        return settings.database_url
    timeout_ms = int(settings.lease_seconds * 1000)
    options = {"options": f"-c idle_in_transaction_session_timeout={timeout_ms}"}
    return url.update_query_dict(options).render_as_string(hide_password=False)


def start_slots(
    queues: Sequence[str], gpus: Sequence[str] | None, settings: Settings, loglevel: str = "INFO"
) -> list[ChildProcess]:
    """Start one slot per GPU (``gpus``), or a single slot when there are none."""
    # Before the slots: they would race to create the queues on a fresh embedded broker.
    declare_queues(queues, settings)
    aliases = {info.validation_alias for info in Settings.model_fields.values()}
    # Only what `settings` says: a variable of this process that it overrides with None must go.
    base_env = {k: v for k, v in os.environ.items() if k not in aliases}
    base_env.update(settings_env(settings))
    base_env[WORKER_NAME_ENV] = process_name()
    if slot_database_url(settings) != settings.database_url:
        base_env["DATABASE_URL"] = slot_database_url(settings)
    procs = []
    slots: list[str | None] = list(gpus) if gpus else [None]
    for gpu in slots:
        env = dict(base_env)
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        name = f"gpu{gpu}" if gpu is not None else "cpu"
        procs.append(spawn_child(slot_command(queues, name, loglevel), env))
    return procs


def stop_slots(procs: Sequence[ChildProcess], timeout_s: float) -> None:
    """Warm-shut every slot down (SIGTERM), then kill whatever is still there after ``timeout_s``."""
    stop_processes(procs, timeout_s, "worker slot")


def run_worker(
    queues: list[str], gpus: list[str] | None = None, settings: Settings | None = None, *, loglevel: str = "INFO"
) -> int:
    """Serve ``queues`` until SIGINT, SIGTERM or SIGHUP; blocks and returns an exit status.

    ``gpus`` (e.g. ``["0", "1"]``) starts one slot per GPU with ``CUDA_VISIBLE_DEVICES`` set; None
    or empty starts one slot (CPU, or whatever devices the environment shows). A first sweep runs
    before the slots start (jobs left ``running`` by a dead worker are requeued or failed), then one
    every ``TRAINJOBS_SWEEP_SECONDS`` while this worker holds the sweeper lease.
    """
    settings = settings or get_settings()
    if not queues:
        raise ValueError("queues: give at least one queue name")
    stopping = False

    def _stop(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    # Before anything else, whatever dispositions this process inherited (worker.processes says why).
    previous = on_stop_signals(_stop)
    first = sweep(settings)
    if first["recovered"] or first["redelivered"]:
        log.info("first sweep: %s", first)
    if stopping:  # asked to stop during the sweep: no slot to start and stop again
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        return 0
    procs = start_slots(queues, gpus, settings, loglevel)
    name = process_name()
    sweeper = Sweeper(settings, queues, name)
    sweeper.slot_pids = [p.pid for p in procs]
    sender = WebhookSender(settings, name).start()
    try:
        while not stopping and all(p.poll() is None for p in procs):
            sweeper.tick(time.monotonic())
            time.sleep(0.2)
    finally:
        # Running jobs get the cancel grace period to checkpoint, plus time to write it down.
        stop_slots(procs, settings.cancel_grace_seconds + 30)
        sender.stop()
        sweeper.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    failed = [p.returncode for p in procs if p.returncode not in (0, -signal.SIGTERM)]
    return 1 if failed and not stopping else 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m worker.main", description="Run trainjobs worker slots.")
    parser.add_argument("--queues", default=None, help="comma-separated queue names (default: the default queue)")
    parser.add_argument("--gpus", default=None, help="comma-separated GPU ids, one slot each (e.g. 0,1)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    settings = get_settings()
    queues = args.queues.split(",") if args.queues else [settings.default_queue]
    gpus = args.gpus.split(",") if args.gpus else None
    return run_worker(queues, gpus, settings)


if __name__ == "__main__":
    raise SystemExit(main())
