"""Commands that talk to a running service: ``submit``, ``jobs ...``, ``datasets ...``, ``usage``
(``estimate --remote`` lives with ``estimate``, ``jobs download`` in ``download``; all share
:mod:`trainjobs.commands.connection`).

They use :class:`trainjobs.client.Client` (``TRAINJOBS_URL`` / ``TRAINJOBS_API_KEY``, or ``--url`` /
``--api-key``). API errors are printed as ``field: message`` lines, never as tracebacks.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from service_core.status import exit_code
from trainjobs.client import Client
from trainjobs.commands.connection import client_for, connection_options, readable_errors
from trainjobs.commands.download import add_download_parser


def emit(value: Any) -> None:
    print(json.dumps(value, indent=2, default=str))


@readable_errors
def cmd_submit(args: argparse.Namespace) -> int:
    from trainjobs.follow import follow

    with client_for(args) as client:
        if args.dry_run:
            emit(client.submit(args.spec, priority=args.priority, queue=args.queue, dry_run=True))
            return 0
        job = client.submit(args.spec, priority=args.priority, queue=args.queue)
        print(job["id"])
        print(f"submitted {job.get('name', '')} as {job['id']} ({job.get('status')})", file=sys.stderr)
        return follow(client, job["id"]) if args.follow else 0


@readable_errors
def cmd_list(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        for job in client.list(status=args.status, limit=args.limit, owner=args.owner):
            progress = job.get("progress") or {}
            step, total = progress.get("step", 0), progress.get("total")
            print(f"{job['id']}  {job['status']:<10} {step}/{total or '?':<8} {job.get('name', '')}")
    return 0


@readable_errors
def cmd_show(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        emit(client.get(args.id))
    return 0


@readable_errors
def cmd_cancel(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        job = client.cancel(args.id)
        print(f"cancel requested for {args.id} ({job.get('status', '')})", file=sys.stderr)
    return 0


@readable_errors
def cmd_pause(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        job = client.pause(args.id)
    status = job.get("status", "")
    said = "paused" if status == "paused" else f"pause requested ({status}: it checkpoints, then pauses)"
    print(f"{args.id} {said}", file=sys.stderr)
    return 0


@readable_errors
def cmd_resume(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        job = client.resume(args.id)
        print(f"{args.id} resumed ({job.get('status', '')})", file=sys.stderr)
    return 0


def _number(value: Any, width: int, digits: int = 4) -> str:
    return f"{value:>{width}.{digits}f}" if isinstance(value, int | float) else f"{'-':>{width}}"


def checkpoint_table(listing: dict[str, Any]) -> list[str]:
    """The lines of ``jobs checkpoints``: one row per checkpoint, oldest first (BEST: ``*``)."""
    metric = str(listing["best_metric"])
    lines = [f"{'STEP':>8} {'EPOCH':>6} {'LOSS':>9} {metric.upper():>12} {'SIZE':>11}  {'TAKEN (UTC)':<19} BEST KEPT"]
    for item in listing["items"]:
        taken = str(item["created_at"])[:19].replace("T", " ")
        lines.append(f"{item['step']:>8} {_number(item['epoch'], 6, 2)} {_number(item['loss'], 9)} "
                     f"{_number(item['eval_metrics'].get(metric), 12)} {item['size'] / 2**20:>7.1f} MiB  {taken:<19} "
                     f"{'*' if item['is_best'] else ' ':<4} {'yes' if item['kept'] else 'no'}")  # fmt: skip
    return lines


@readable_errors
def cmd_checkpoints(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        listing = client.checkpoints(args.id)
    for line in checkpoint_table(listing):
        print(line)
    if not listing["items"]:
        print(f"job {args.id} has no complete checkpoint yet", file=sys.stderr)
    return 0


def print_output(client: Client, job_id: str, follow: bool) -> int:
    """The run's combined stdout/stderr on stdout; following, until the job ends, with its exit status."""
    chunks = client.follow_log(job_id) if follow else client.log_text(job_id)
    for text in chunks:
        sys.stdout.write(text)
        sys.stdout.flush()
    return exit_code(str(client.get(job_id)["status"])) if follow else 0


@readable_errors
def cmd_logs(args: argparse.Namespace) -> int:
    from trainjobs.follow import describe, follow

    with client_for(args) as client:
        if args.output:
            return print_output(client, args.id, args.follow)
        if args.follow:
            return follow(client, args.id)
        # Without --follow: what the job said so far (the replay), then stop.
        for event in client.events(args.id, idle_timeout=2.0):
            print(describe(event))
    return 0


@readable_errors
def cmd_dataset_upload(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        dataset = client.upload_dataset(args.path, name=args.name)
        print(dataset["id"])
        print(f"uploaded {args.path} as dataset {dataset['id']}; use {{\"dataset\": {{\"id\": ...}}}}", file=sys.stderr)
    return 0


@readable_errors
def cmd_dataset_list(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        for dataset in client.datasets():
            print(f"{dataset['id']}  {dataset.get('format', ''):<12} {dataset.get('name', '')}")
    return 0


def usage_table(report: dict[str, Any]) -> list[str]:
    """The lines of ``usage``: one row per group, then the total (cost "-" where no job had a price)."""
    lines = [f"{report['group_by'].upper():<24} {'DEVICE-HOURS':>13} {'COST':>12}  JOBS"]
    for group in [*report["groups"], report["total"]]:
        jobs = ", ".join(f"{n} {status}" for status, n in sorted(group["jobs"].items())) or "-"
        lines.append(f"{group['key']:<24} {group['device_hours']:>13.4f} {_number(group['cost'], 12, 2)}  {jobs}")
    return lines


@readable_errors
def cmd_usage(args: argparse.Namespace) -> int:
    with client_for(args) as client:
        report = client.usage(start=args.start, end=args.end, group_by=args.group_by, owner=args.owner)
    if args.json:
        emit(report)
        return 0
    print(f"jobs that finished from {report['from']} to {report['to']}", file=sys.stderr)
    for line in usage_table(report):
        print(line)
    return 0


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    conn = connection_options()
    submit = subparsers.add_parser("submit", parents=[conn], help="submit a job spec (YAML or JSON) to the service")
    submit.add_argument("spec", help="job spec file")
    submit.add_argument("--follow", "-f", action="store_true", help="show live progress; exit with the outcome")
    submit.add_argument("--priority", type=int, default=None)
    submit.add_argument("--queue", default=None, help="queue (e.g. a GPU memory class such as gpu-80g)")
    submit.add_argument(
        "--dry-run", action="store_true", help="only check the job (preflight, estimate) and print the report"
    )
    submit.set_defaults(func=cmd_submit)

    jobs = subparsers.add_parser("jobs", help="list, show, cancel, pause, resume and follow jobs")
    jobs_sub = jobs.add_subparsers(dest="jobs_command", metavar="ACTION", required=True)
    listing = jobs_sub.add_parser("list", parents=[conn], help="jobs, newest first")
    listing.add_argument("--status", default=None)
    listing.add_argument("--owner", default=None, help="only this owner's jobs (another owner's: admin keys only)")
    listing.add_argument("--limit", type=int, default=20)
    listing.set_defaults(func=cmd_list)
    for name, func, text in (
        ("show", cmd_show, "one job as JSON"), ("cancel", cmd_cancel, "cancel a job"),
        ("pause", cmd_pause, "pause a job: it checkpoints and frees its slot"),
        ("resume", cmd_resume, "put a paused job back on its queue"),
    ):  # fmt: skip
        action = jobs_sub.add_parser(name, parents=[conn], help=text)
        action.add_argument("id")
        action.set_defaults(func=func)
    logs = jobs_sub.add_parser("logs", parents=[conn], help="a job's events, or with --output the run's own output")
    logs.add_argument("id")
    logs.add_argument("--follow", "-f", action="store_true", help="live progress bar (or output) until the job ends")
    logs.add_argument(
        "--output", action="store_true", help="the run process's own stdout/stderr instead of the event view"
    )
    logs.set_defaults(func=cmd_logs)

    checkpoints = jobs_sub.add_parser("checkpoints", parents=[conn], help="a job's checkpoints as a table")
    checkpoints.add_argument("id")
    checkpoints.set_defaults(func=cmd_checkpoints)
    add_download_parser(jobs_sub, conn)

    datasets = subparsers.add_parser("datasets", help="upload and list datasets")
    ds_sub = datasets.add_subparsers(dest="datasets_command", metavar="ACTION", required=True)
    upload = ds_sub.add_parser("upload", parents=[conn], help="upload a file, or a folder (zipped)")
    upload.add_argument("path")
    upload.add_argument("--name", default=None)
    upload.set_defaults(func=cmd_dataset_upload)
    ds_list = ds_sub.add_parser("list", parents=[conn], help="your datasets")
    ds_list.set_defaults(func=cmd_dataset_list)

    usage = subparsers.add_parser("usage", parents=[conn], help="device-hours and cost of finished jobs")
    usage.add_argument("--from", dest="start", default=None, help="start, ISO 8601 (default: this UTC month)")
    usage.add_argument("--to", dest="end", default=None, help="end, exclusive (default: now)")
    usage.add_argument("--group-by", choices=("owner", "queue", "day"), default="day")
    usage.add_argument("--owner", default=None, help="only this owner's jobs (another owner's: admin keys only)")
    usage.add_argument("--json", action="store_true", help="the API's answer as JSON")
    usage.set_defaults(func=cmd_usage)
