"""What every command that talks to the service shares: ``--url``/``--api-key``, the client, and
turning the client's errors into ``field: message`` lines and an exit status (never a traceback)."""

from __future__ import annotations

import argparse
import functools
import logging
import sys
from collections.abc import Callable

from service_core.status import EXIT_REFUSED
from trainjobs.client import ApiError, Client, TrainjobsError

Handler = Callable[[argparse.Namespace], int]


def connection_options() -> argparse.ArgumentParser:
    """``--url`` and ``--api-key``, shared by every remote command (also ``estimate --remote``)."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--url", default=None, help="service address (default: $TRAINJOBS_URL or localhost:8000)")
    parent.add_argument("--api-key", default=None, help="API key (default: $TRAINJOBS_API_KEY)")
    return parent


def client_for(args: argparse.Namespace) -> Client:
    # httpx logs every request at INFO: noise on a terminal that shows a progress bar.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    return Client(getattr(args, "url", None), getattr(args, "api_key", None))


def report_error(exc: BaseException) -> int:
    """Print an error for a person (title, then one ``field: message`` line per field).

    The exit status is :data:`~service_core.status.EXIT_REFUSED` whether the service refused the request
    or could not be reached: either way nothing ran (job outcomes: :data:`~service_core.status.EXIT_CODES`).
    """
    if isinstance(exc, ApiError):
        print(f"error: {exc.title} ({exc.status})", file=sys.stderr)
        if exc.detail and not exc.errors:
            print(str(exc.detail), file=sys.stderr)
        for line in exc.lines():
            print(line, file=sys.stderr)
        from trainjobs.commands.advice import over_budget_lines

        for line in over_budget_lines(exc.body):
            print(line, file=sys.stderr)
    elif isinstance(exc, FileNotFoundError):
        print(f"error: no such file: {exc.filename}", file=sys.stderr)
    else:
        print(f"error: {exc}", file=sys.stderr)
    return EXIT_REFUSED


def readable_errors(func: Handler) -> Handler:
    """Turn the client's errors (and unreadable input files) into messages and an exit status."""

    @functools.wraps(func)
    def wrapper(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except (TrainjobsError, OSError, ValueError) as exc:
            return report_error(exc)
        except KeyboardInterrupt:
            print("interrupted (the job keeps running; `trainjobs jobs cancel ID` stops it)", file=sys.stderr)
            return 130

    return wrapper
