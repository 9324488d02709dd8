"""``trainjobs validate SPEC``: the submit-time checks (spec, data, model) on this machine, no service.

Prints the preflight report (splits with row counts, the label set, where the model comes from) as
JSON on stdout. Exit status 0 when the spec passes, 2 with one ``field: message`` line per problem.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from trainer_core.cli import print_spec_errors
from trainer_core.spec import SpecError, load_spec_file


def run_validate(args: argparse.Namespace) -> int:
    from trainer_core.preflight import preflight

    try:
        report = preflight(load_spec_file(args.spec))
    except SpecError as exc:
        return print_spec_errors(exc)
    except OSError as exc:
        print(f"spec: cannot read {args.spec}: {exc.strerror}", file=sys.stderr)
        return 2
    print(json.dumps(report.as_dict(), indent=2))
    return 0


def register(subparsers: Any) -> None:
    """Add ``validate`` to the ``trainjobs`` command."""
    parser = subparsers.add_parser("validate", help="check a job spec, its data and its model without training")
    parser.add_argument("spec", type=Path, help="job spec file, YAML or JSON")
    parser.set_defaults(func=run_validate)
