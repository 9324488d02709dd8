"""``trainjobs gc --older-than 90d [--keep-artifacts] [--dry-run]``: retention for a long-lived service.

Runs against the service's database and artifact store (the same settings as ``trainjobs serve``);
the work itself is :func:`service_core.retention.collect_garbage`, in short batches that leave the
running service responsive.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any


def cmd_gc(args: argparse.Namespace) -> int:
    """Collect, print what went, and exit 0 (2 for an unreadable ``--older-than``)."""
    from sqlalchemy.orm import sessionmaker

    from service_core.artifacts import ArtifactStore
    from service_core.db.session import make_engine
    from service_core.durations import parse_duration
    from service_core.retention import collect_garbage
    from service_core.settings import Settings

    try:
        age = parse_duration(args.older_than)
    except ValueError as exc:
        print(f"--older-than: {exc}", file=sys.stderr)
        return 2
    settings = Settings()
    engine = make_engine(settings.database_url)
    try:
        report = collect_garbage(
            sessionmaker(bind=engine), age, keep_artifacts=args.keep_artifacts,
            artifacts=ArtifactStore(settings.artifacts_root), batch_rows=args.batch_rows, dry_run=args.dry_run,
        )  # fmt: skip
    finally:
        engine.dispose()
    verb = "would delete" if args.dry_run else "deleted"
    what = "jobs' history" if args.keep_artifacts else "jobs"
    print(f"{verb} {report.jobs} {what} finished over {args.older_than} ago: {report.metric_points} metric points, "
          f"{report.events} events, {report.artifact_dirs} artifact folders ({report.batches} transactions)")
    return 0


def register(subparsers: Any) -> None:
    """Add ``gc`` to the ``trainjobs`` command."""
    parser = subparsers.add_parser("gc", help="delete old finished jobs' metric points, events, rows and artifacts")
    parser.add_argument("--older-than", required=True, help="age of the finish time, e.g. 90d, 12h, 30m")
    parser.add_argument("--keep-artifacts", action="store_true",
                        help="keep the job rows and their artifacts; delete only metric points and events")
    parser.add_argument("--batch-rows", type=int, default=5000, help="rows per delete transaction")
    parser.add_argument("--dry-run", action="store_true", help="count the jobs that would go, delete nothing")
    parser.set_defaults(func=cmd_gc)
