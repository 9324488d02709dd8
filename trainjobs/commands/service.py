"""Running the service: ``trainjobs migrate``, ``serve``, ``worker``, ``dev``, ``keys``.

``migrate``, ``serve`` and ``worker`` are the production processes (docker-compose runs exactly these);
``serve`` and ``worker`` refuse a database that ``migrate`` has not brought up to this package's schema.
``dev`` is the one-command local service (see :mod:`trainjobs.launcher`); it migrates by itself.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from types import FrameType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from service_core.settings import Settings

log = logging.getLogger(__name__)


def load_settings() -> Settings:
    """The service's settings, imported on use: `trainjobs --help` lists these commands on the lean
    install, which lacks pydantic-settings (the [server] extra brings it)."""
    from service_core.settings import Settings

    return Settings()


def quiet_alembic() -> None:
    """Alembic logs its plugin set-up at INFO, on import (so call this first); what the commands did,
    they print themselves."""
    logging.getLogger("alembic").setLevel(logging.WARNING)


def schema_refusal(settings: Settings) -> bool:
    """Print one line and return True when the database is missing or behind the packaged migrations
    (instead of a traceback about a missing table from the first query)."""
    quiet_alembic()
    from service_core.migrations import schema_problem

    problem = schema_problem(settings.database_url)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
    return problem is not None


def cmd_migrate(_args: argparse.Namespace) -> int:
    """``alembic upgrade head`` on ``DATABASE_URL`` from the scripts inside the installed package."""
    quiet_alembic()
    from sqlalchemy.exc import OperationalError

    from service_core.migrations import apply_migrations, redact_url

    database_url = load_settings().database_url
    shown = redact_url(database_url)
    try:
        done = apply_migrations(database_url)
    except OperationalError as exc:
        print(f"error: cannot migrate {shown}: {' '.join(str(exc.orig).split())}", file=sys.stderr)
        return 2
    if done.before == done.after:
        print(f"{shown} is at revision {done.after} (head): nothing to do")
    else:
        print(f"migrated {shown} from {done.before or 'an empty database'} to revision {done.after} (head)")
    return 0


def tcp_nodelay_listener() -> None:
    """Make uvicorn's ``--workers N`` listener hand out sockets that get TCP_NODELAY (idempotent).

    uvicorn 0.54 binds that listener with ``proto`` 0; accepted sockets inherit it and asyncio sets
    TCP_NODELAY only when it sees IPPROTO_TCP, so every keep-alive request after the first waits
    ~40 ms for a delayed ACK (Kludex/uvicorn#3149). Re-wrapping the descriptor lets the socket module
    read the real protocol back from the kernel. A single API process (``--api-processes 1``) is not
    affected.
    """
    import socket

    import uvicorn.config

    bind = uvicorn.config.Config.bind_socket
    if getattr(bind, "trainjobs_nodelay", False):
        return

    def bind_tcp(config: uvicorn.config.Config) -> socket.socket:
        sock = bind(config)
        if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.proto == 0:
            sock = socket.socket(fileno=sock.detach())
            sock.set_inheritable(True)
        return sock

    bind_tcp.trainjobs_nodelay = True  # type: ignore[attr-defined]
    uvicorn.config.Config.bind_socket = bind_tcp  # type: ignore[method-assign,assignment]


def _hangup_as_sigterm(_signum: int, _frame: FrameType | None) -> None:
    # uvicorn handles SIGINT and SIGTERM only: a closed terminal (SIGHUP) would kill the API mid-request.
    signal.raise_signal(signal.SIGTERM)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from service_core.logging import configure_logging
    from trainjobs.serving import reuse_port_supported, serve_api_processes
    from worker.processes import on_stop_signals

    # Stop signals stop it from the start, whatever dispositions it inherited (worker.processes says
    # why); uvicorn and `serve_api_processes` put their graceful handlers over these while they serve.
    on_stop_signals()
    settings = load_settings()
    try:
        settings.check_production_ready()
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if schema_refusal(settings):
        return 2
    configure_logging()
    if args.api_processes > 1 and reuse_port_supported():
        # One listener per process, so connections spread evenly (trainjobs.serving says why).
        try:
            return serve_api_processes(args.host, args.port, args.api_processes, access_log=args.access_log)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    tcp_nodelay_listener()
    signal.signal(signal.SIGHUP, _hangup_as_sigterm)
    uvicorn.run(
        "api.main:create_app",
        factory=True,
        host=args.host,
        port=args.port,
        workers=args.api_processes,  # uvicorn's word for its processes
        log_config=None,  # keep our structured logging
        proxy_headers=True,
        access_log=args.access_log,
    )
    return 0


def parse_gpus(text: str | None) -> list[str] | None:
    """``"0,1"`` -> ``["0", "1"]``; None or empty means no GPU pinning (one slot)."""
    if not text:
        return None
    gpus = [g.strip() for g in text.split(",") if g.strip()]
    if not gpus:
        raise argparse.ArgumentTypeError("--gpus: give device indexes such as 0,1")
    return gpus


def cmd_worker(args: argparse.Namespace) -> int:
    from worker.processes import on_stop_signals

    on_stop_signals()  # while it starts; run_worker then stops its slots on them (worker.processes says why)
    from service_core.logging import configure_logging
    from worker.main import run_worker

    settings = load_settings()
    if schema_refusal(settings):
        return 2
    configure_logging()
    queues = args.queue or [settings.default_queue]
    result = run_worker(queues=queues, gpus=parse_gpus(args.gpus), settings=settings)
    return int(result or 0)


def cmd_dev(args: argparse.Namespace) -> int:
    from worker.processes import on_stop_signals

    on_stop_signals()  # while it imports; DevLauncher.run installs them again for its own run
    from trainjobs.launcher import DevLauncher

    return DevLauncher(load_settings(), host=args.host, port=args.port, example=args.example, s3=args.s3).run()


def cmd_keys_create(args: argparse.Namespace) -> int:
    from service_core.db.base import utcnow
    from service_core.db.session import session_scope
    from service_core.durations import parse_duration
    from service_core.keys import create_api_key

    settings = load_settings()
    try:
        expires_at = utcnow() + parse_duration(args.expires) if args.expires else None
    except ValueError as exc:
        print(f"--expires: {exc}", file=sys.stderr)
        return 2
    try:
        with session_scope(settings.database_url) as session:
            key = create_api_key(session, args.owner, args.admin, settings=settings, expires_at=expires_at)
    except ValueError as exc:
        print(f"owner: {exc}", file=sys.stderr)
        return 2
    print(key)
    return 0


def cmd_keys_list(_args: argparse.Namespace) -> int:
    """Every key with its state; never the key itself (only its prefix)."""
    from sqlalchemy import select

    from service_core.db.models import ApiKey
    from service_core.db.session import session_scope

    def when(value: object) -> str:
        return value.strftime("%Y-%m-%d %H:%M") if hasattr(value, "strftime") else "-"

    with session_scope(load_settings().database_url) as session:
        rows = session.execute(select(ApiKey).order_by(ApiKey.created_at.desc(), ApiKey.id.desc())).scalars().all()
        lines = [f"{'ID':<32}  {'OWNER':<16} {'PREFIX':<10} {'ADMIN':<5}  {'CREATED':<16}  {'EXPIRES':<16}  "
                 f"{'LAST USED':<16}  REVOKED"]  # fmt: skip
        lines += [
            f"{row.id:<32}  {row.owner:<16} {row.prefix:<10} {'yes' if row.is_admin else 'no':<5}  "
            f"{when(row.created_at):<16}  {when(row.expires_at):<16}  {when(row.last_used_at):<16}  "
            f"{when(row.revoked_at)}"
            for row in rows
        ]
    print("\n".join(lines))
    return 0


def cmd_keys_revoke(args: argparse.Namespace) -> int:
    from service_core.db.session import session_scope
    from service_core.keys import revoke_api_key

    settings = load_settings()
    with session_scope(settings.database_url) as session:
        row = revoke_api_key(session, args.key_id)
    if row is None:
        print(f"key_id: no key {args.key_id!r} (`trainjobs keys list` shows them)", file=sys.stderr)
        return 2
    print(f"revoked {args.key_id} ({row.owner}); API processes that checked it within the last "
          f"{settings.auth_cache_seconds:g} s may accept it until then")  # fmt: skip
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    migrate = subparsers.add_parser("migrate", help="create or upgrade the database schema (DATABASE_URL)")
    migrate.set_defaults(func=cmd_migrate)

    serve = subparsers.add_parser("serve", help="run the HTTP API (uvicorn)")
    serve.add_argument("--host", default="0.0.0.0")
    serve.add_argument("--port", type=int, default=8000)
    # --workers: the flag's deprecated name, kept for the scripts that pass it ("worker" is `trainjobs worker`).
    serve.add_argument(
        "--api-processes", "--workers", dest="api_processes", type=int, default=1, metavar="N",
        help="API processes, on Linux each with its own SO_REUSEPORT listener (--workers: deprecated name)",
    )  # fmt: skip
    serve.add_argument("--no-access-log", dest="access_log", action="store_false", help="no line per request")
    serve.set_defaults(func=cmd_serve)

    worker = subparsers.add_parser("worker", help="run a training worker (one slot per GPU)")
    worker.add_argument("--gpus", default=None, help="GPU indexes, one slot each, e.g. 0,1")
    worker.add_argument(
        "--queue", action="append", default=None, help="queue to consume (repeatable; default: the default queue)"
    )
    worker.set_defaults(func=cmd_worker)

    dev = subparsers.add_parser("dev", help="API + one worker on the embedded defaults under ./var")
    dev.add_argument("--host", default="127.0.0.1")
    dev.add_argument("--port", type=int, default=int(os.environ.get("TRAINJOBS_PORT", "8000")), help="$TRAINJOBS_PORT")
    dev.add_argument("--example", action="store_true", help="print a curl command that submits an example job")
    dev.add_argument(
        "--s3", action="store_true", help="also start a SeaweedFS under the home for artifacts, checkpoints and data"
    )
    dev.set_defaults(func=cmd_dev)

    keys = subparsers.add_parser("keys", help="manage API keys")
    keys_sub = keys.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    create = keys_sub.add_parser("create", help="create a key and print it (shown once)")
    create.add_argument("--owner", required=True)
    create.add_argument("--admin", action="store_true", help="the key sees every owner's jobs")
    create.add_argument("--expires", default=None, metavar="AGE", help="the key stops working after 30d, 12h, 90m...")
    create.set_defaults(func=cmd_keys_create)
    listing = keys_sub.add_parser("list", help="every key: owner, prefix, created, expires, last used, revoked")
    listing.set_defaults(func=cmd_keys_list)
    revoke = keys_sub.add_parser("revoke", help="revoke a key by its id (from `keys list`)")
    revoke.add_argument("key_id")
    revoke.set_defaults(func=cmd_keys_revoke)
