"""Entry point of each torchrun rank: ``python -m trainer_core.rank_entry SPEC --output-dir DIR``.

:func:`trainer_core.launch.run_distributed` starts one per process (or, forked from the run, calls
:func:`main` in each). Every rank runs the job; only rank 0 prints events (JSON lines on stdout), which
the launching process relays.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from trainer_core.events import EXIT_INVALID_SPEC, RUN_EXIT_CODES, stream_sink
from trainer_core.path_guard import add_reach_arguments, reach_from
from trainer_core.preimport import preimport, run_modules
from trainer_core.spec import SpecError, load_spec_file


def main(argv: Sequence[str] | None = None) -> int:
    """Run this rank's share of the job; the exit status follows :data:`~trainer_core.events.RUN_EXIT_CODES`."""
    parser = argparse.ArgumentParser(prog="python -m trainer_core.rank_entry")
    parser.add_argument("spec", type=Path)
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--stop-file", type=Path)
    parser.add_argument("--cache-dir", type=Path)
    add_reach_arguments(parser)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    emit = stream_sink(sys.stdout) if int(os.environ.get("RANK", "0")) == 0 else None
    try:
        spec = load_spec_file(args.spec)
        preimport(run_modules(spec))  # torch, transformers and the backend, the collector paused
        from trainer_core.run import train_job

        status = train_job(spec, args.output_dir, emit=emit, resume=args.resume, stop_file=args.stop_file,
                           cache_dir=args.cache_dir, reach=reach_from(args))
    except SpecError:
        return EXIT_INVALID_SPEC
    return RUN_EXIT_CODES[status]


if __name__ == "__main__":
    raise SystemExit(main())
