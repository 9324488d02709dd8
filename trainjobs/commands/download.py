"""``trainjobs jobs download ID [--to DIR] [--path P | --checkpoint STEP|best|last]``: a job's output, one file
of it, or one of its checkpoints, with a progress bar."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainjobs.commands.connection import client_for, readable_errors


@readable_errors
def cmd_download(args: argparse.Namespace) -> int:
    """Download into ``--to`` (default ``./<job id>``); print each file written."""
    from tqdm import tqdm

    dest = Path(args.to) if args.to else Path(args.id)
    if args.checkpoint is not None:
        return download_checkpoint(args, dest)
    with client_for(args) as client:
        items = client.artifacts(args.id)
        if args.path is not None:
            items = [i for i in items if i["path"] == args.path] or [{"path": args.path, "size": None}]
        total = sum(int(i.get("size") or 0) for i in items) or None
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr,
                  disable=None, desc=args.id) as bar:  # fmt: skip
            written: tuple[Path, ...]
            if args.path is not None:
                written = (client.download(args.id, args.path, dest, progress=bar.update),)
            else:
                written = client.download_all(args.id, dest, progress=bar.update)
    for path in written:
        print(path)
    print(f"{len(written)} file(s) in {dest}", file=sys.stderr)
    return 0


def download_checkpoint(args: argparse.Namespace, dest: Path) -> int:
    """``--checkpoint STEP|best|last``: that checkpoint, unpacked into ``dest/checkpoint-<step>``."""
    from tqdm import tqdm

    with client_for(args) as client:
        step = client.checkpoint_step(args.id, args.checkpoint)
        with tqdm(unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr, disable=None,
                  desc=f"{args.id} checkpoint {step}") as bar:  # fmt: skip
            folder = client.download_checkpoint(args.id, step, dest, with_optimizer=args.with_optimizer,
                                                progress=bar.update)  # fmt: skip
    print(folder)
    return 0


def add_download_parser(jobs_sub: argparse._SubParsersAction, conn: argparse.ArgumentParser) -> None:
    """Add ``jobs download`` under ``trainjobs jobs``."""
    parser = jobs_sub.add_parser("download", parents=[conn], help="download a job's model and files")
    parser.add_argument("id")
    parser.add_argument("--to", default=None, help="folder to write into (created; default ./ID)")
    parser.add_argument("--path", default=None, help="only this artifact (e.g. metrics.json)")
    parser.add_argument(
        "--checkpoint", default=None, metavar="STEP|best|last",
        help="a checkpoint instead, unpacked into DIR/checkpoint-STEP (a loadable model and its tokenizer)",
    )  # fmt: skip
    parser.add_argument("--with-optimizer", action="store_true", help="with --checkpoint: keep the optimizer state")
    parser.set_defaults(func=cmd_download)
