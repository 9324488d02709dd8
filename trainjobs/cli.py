"""The ``trainjobs`` command: a thin dispatcher over one module per command group.

Each module in ``trainjobs.commands`` exposes ``register(subparsers)``; it is imported lazily so
``trainjobs train`` does not pay for FastAPI and ``trainjobs submit`` does not pay for torch.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

# command name -> module that registers it (several names may share one module)
COMMANDS: dict[str, str] = {
    "train": "trainjobs.commands.train",
    "validate": "trainjobs.commands.validate",
    "estimate": "trainjobs.commands.estimate",
    "migrate": "trainjobs.commands.service",
    "serve": "trainjobs.commands.service",
    "worker": "trainjobs.commands.service",
    "dev": "trainjobs.commands.service",
    "keys": "trainjobs.commands.service",
    "submit": "trainjobs.commands.remote",
    "jobs": "trainjobs.commands.remote",
    "datasets": "trainjobs.commands.remote",
    "usage": "trainjobs.commands.remote",
    "webhooks": "trainjobs.commands.webhooks",
    "gc": "trainjobs.commands.gc",
}
# The extra a command needs beyond `pip install trainjobs` (the remote commands need none).
EXTRAS: dict[str, str] = {"train": "train", "estimate": "train", "migrate": "server", "serve": "server",
                          "worker": "all", "dev": "all", "keys": "server"}  # fmt: skip
PROJECT_PACKAGES = frozenset({"trainer_core", "service_core", "api", "worker", "trainjobs"})


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trainjobs", description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    modules = [COMMANDS[only]] if only in COMMANDS else list(dict.fromkeys(COMMANDS.values()))
    for name in modules:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # a real missing dependency, not a command group not built yet
                raise
            continue
        module.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    # Import only the module of the command asked for; `--help` alone loads them all.
    first = next((a for a in args_list if not a.startswith("-")), None)
    parser = build_parser(first)
    args = parser.parse_args(args_list)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(message)s")
    try:
        result: int = args.func(args)
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if args.command not in EXTRAS or not missing or missing in PROJECT_PACKAGES:
            raise
        print(f"error: `trainjobs {args.command}` needs {missing}, which this install lacks: "
              f"pip install 'trainjobs[{EXTRAS[args.command]}]'", file=sys.stderr)  # fmt: skip
        return 2
    return result


if __name__ == "__main__":
    raise SystemExit(main())
