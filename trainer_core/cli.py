"""``python -m trainer_core SPEC --output-dir DIR``: run a job on this machine, no service needed.

By default a progress bar with the live loss; ``--jsonl`` prints the run's events instead, one JSON
object per line on stdout (what the worker parses). The exit status follows
:data:`~trainer_core.events.RUN_EXIT_CODES` (0 succeeded, 1 failed, 3 cancelled), and is
:data:`~trainer_core.events.EXIT_INVALID_SPEC` (2) for a spec that cannot run, each problem printed
as ``field: message``. ``trainjobs train`` is this command under the trainjobs CLI.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainer_core.events import EXIT_INVALID_SPEC, RUN_EXIT_CODES, Event, EventSink, make_event, stream_sink
from trainer_core.launch import Rendezvous
from trainer_core.path_guard import add_reach_arguments, check_reach, reach_from
from trainer_core.preimport import preimport, run_modules
from trainer_core.spec import SpecError, load_spec_file


class ProgressBar:
    """An event sink that draws a tqdm bar, shows loss as it goes and prints evaluations."""

    def __init__(self) -> None:
        self._bar: Any = None

    def __call__(self, event: Event) -> None:
        from tqdm import tqdm

        kind = event["event"]
        if kind == "progress":
            if self._bar is None:
                self._bar = tqdm(total=event["total_steps"], initial=event["step"] - 1, unit="step",
                                 dynamic_ncols=True)
            self._bar.update(event["step"] - self._bar.n)
        elif kind == "metric" and self._bar is not None:
            values = event["values"]
            self._bar.set_postfix(loss=f"{values['loss']:.4f}" if values.get("loss") is not None else "nan")
        elif kind == "eval":
            shown = ", ".join(f"{k.removeprefix('eval_')}={v:.4f}" for k, v in event["values"].items()
                              if isinstance(v, float))
            tqdm.write(f"eval @ step {event['step']}: {shown}")
        elif kind == "done":
            self.close()
            summary = event.get("summary") or {}
            detail = summary.get("error") or ", ".join(
                f"{k}={v:.4f}" for k, v in (summary.get("eval") or {}).items() if isinstance(v, float)
            )
            print(f"{event['status']}: {detail}" if detail else event["status"], file=sys.stderr)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def print_spec_errors(exc: SpecError) -> int:
    """One ``field: message`` line per problem on stderr; the exit status of a spec that cannot run."""
    for error in exc.errors:
        print(f"{error.field}: {error.message}", file=sys.stderr)
    return EXIT_INVALID_SPEC


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of a local run, shared by ``python -m trainer_core`` and ``trainjobs train``."""
    parser.add_argument("spec", type=Path, help="job spec file, YAML or JSON")
    parser.add_argument("--output-dir", type=Path, required=True, help="model, metrics and checkpoints go here")
    parser.add_argument("--jsonl", action="store_true", help="print events as JSON lines instead of a bar")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    parser.add_argument("--stop-file", type=Path, help="stop gracefully once this file exists")
    parser.add_argument("--cache-dir", type=Path, help="preprocessed-data cache (default: none)")
    parser.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                        help="a job of several nodes (resources.num_nodes): where they meet, the same on each; "
                        "the first node to start hosts it")  # fmt: skip
    parser.add_argument("--rdzv-id", help="the multi-node run's id, the same on each node (default: the spec's name)")
    parser.add_argument("--rdzv-local-addr", metavar="ADDR",
                        help="the address the other nodes reach this one at (default: its host name)")
    parser.add_argument("--rdzv-host", action=argparse.BooleanOptionalAction, default=None,
                        help="this node serves the rendezvous store (default: the node whose address the endpoint "
                        "names)")
    add_reach_arguments(parser)


def rendezvous_from(args: argparse.Namespace, name: str) -> Rendezvous | None:
    """The ``--rdzv-*`` arguments (None: a job on this machine alone)."""
    if not args.rdzv_endpoint:
        return None
    return Rendezvous(args.rdzv_endpoint, args.rdzv_id or name, local_addr=args.rdzv_local_addr,
                      is_host=args.rdzv_host)


def run_train(args: argparse.Namespace) -> int:
    """Validate the spec, preflight it, train it, and map the outcome to an exit status."""
    try:
        spec = load_spec_file(args.spec)
    except SpecError as exc:
        return print_spec_errors(exc)
    except OSError as exc:
        print(f"spec: cannot read {args.spec}: {exc.strerror}", file=sys.stderr)
        return EXIT_INVALID_SPEC
    # torch loads here, not when the CLI builds its parser; all at once, the collector paused.
    preimport(("trainer_core.failures", "trainer_core.preflight", *run_modules(spec)))
    from trainer_core.failures import failure_summary
    from trainer_core.preflight import preflight
    from trainer_core.run import train_job

    bar = None if args.jsonl else ProgressBar()
    sink: EventSink = stream_sink(sys.stdout) if bar is None else bar
    reach = reach_from(args)
    try:
        # The checks a submit makes, before any model is built (data may have changed since); a failure
        # ends the run as train_job would, with a done event naming the reason. Paths first: preflight
        # reads them.
        check_reach(spec, reach)
        preflight(spec)
    except SpecError as exc:
        sink(make_event("done", status="failed", summary=failure_summary(exc)))
        return print_spec_errors(exc)
    try:
        status = train_job(spec, args.output_dir, emit=sink, resume=args.resume, stop_file=args.stop_file,
                           cache_dir=args.cache_dir, reach=reach, rendezvous=rendezvous_from(args, spec.name))
    except SpecError as exc:
        return print_spec_errors(exc)
    finally:
        if bar is not None:
            bar.close()
    return RUN_EXIT_CODES[status]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m trainer_core``: parse the arguments and run the job."""
    parser = argparse.ArgumentParser(prog="python -m trainer_core", description="train a job spec on this machine")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    add_train_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(message)s")
    return run_train(args)
