"""``trainjobs train SPEC --output-dir DIR``: ``python -m trainer_core`` under the trainjobs command.

The arguments, the progress bar and the exit statuses live in :mod:`trainer_core.cli`.
"""

from __future__ import annotations

from typing import Any

from trainer_core.cli import add_train_arguments, run_train


def register(subparsers: Any) -> None:
    """Add ``train`` to the ``trainjobs`` command."""
    parser = subparsers.add_parser("train", help="train a job spec (YAML or JSON) on this machine")
    add_train_arguments(parser)
    parser.set_defaults(func=run_train)
