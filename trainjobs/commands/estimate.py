"""``trainjobs estimate SPEC``: will this job fit, and what to change if it does not.

The command computes one JSON-able payload (:func:`local_payload`), or with ``--remote`` asks the
service for it (:func:`remote_payload`), and renders either with
:func:`trainjobs.memory_table.render_estimate`. The remote path loads no torch: the lean client has it.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

from trainjobs.commands.connection import client_for, connection_options, readable_errors
from trainjobs.memory_table import render_estimate

UNITS = {"": 1024**3, "g": 1024**3, "gib": 1024**3, "gb": 1000**3, "m": 1024**2, "mib": 1024**2, "mb": 1000**2}


def parse_memory(text: str) -> float:
    """A memory size such as ``24GiB``, ``80GB``, ``24`` (GiB) or ``512MiB``, returned in GiB."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in UNITS or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"--gpu-memory: expected a size like 24GiB, 80GB or 512MiB, got {text!r}")
    return float(match.group(1)) * UNITS[unit] / 1024**3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``estimate``, ``--remote`` included (``--url``/``--api-key`` come as a parent parser)."""
    parser.add_argument("spec", metavar="SPEC", help="job spec file (YAML or JSON)")
    parser.add_argument(
        "--gpu-memory",
        type=parse_memory,
        default=None,
        metavar="SIZE",
        help="per-device budget, e.g. 24GiB or 80GB; lists the settings that fit",
    )
    parser.add_argument("--devices", type=int, default=None, metavar="N", help="number of devices (DDP)")
    parser.add_argument(
        "--max-nodes", type=int, default=1, metavar="N",
        help="machines the plan may shard a full fine-tune over (--remote: the queue's live workers)",
    )  # fmt: skip
    parser.add_argument(
        "--train-rows", type=int, default=None, metavar="N",
        help="with --remote: the time and cost of training on N rows, on --queue (the service's calibration)",
    )  # fmt: skip
    parser.add_argument("--eval-rows", type=int, default=0, metavar="N", help="with --train-rows: rows evaluated")
    parser.add_argument("--queue", default=None, help="with --train-rows: the queue to time it on")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--remote", action="store_true", help="ask the service ($TRAINJOBS_URL, $TRAINJOBS_API_KEY) instead"
    )


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "estimate", parents=[connection_options()], help="estimate per-device GPU memory of a job spec"
    )
    add_arguments(parser)
    parser.set_defaults(func=run)


def local_payload(spec_path: str, gpu_memory_gb: float | None, devices: int | None, max_nodes: int = 1
                  ) -> dict[str, Any]:  # fmt: skip
    """The estimate (and the plan when a budget is known) as one JSON-able object."""
    from trainer_core.auto import Budget, device_budget, resolve_auto
    from trainer_core.memory import TOTAL_FORMULA, estimate_memory, plan_memory
    from trainer_core.spec import load_spec_file

    spec = load_spec_file(spec_path)
    budget = gpu_memory_gb if gpu_memory_gb is not None else spec.resources.gpu_memory_gb
    choices: list[Any] = []
    if spec.training.auto:  # as a run here would choose them (epochs stay auto: the rows are not read)
        sized = Budget(budget, "the budget given") if budget is not None else device_budget()
        spec, choices = resolve_auto(spec, budget=sized, train_rows=None, partial=True)
    estimate = estimate_memory(spec, devices=devices, gpu_memory_gb=gpu_memory_gb)
    payload: dict[str, Any] = {**estimate.model_dump(mode="json"), "total_formula": TOTAL_FORMULA}
    if choices:
        payload["auto"] = [choice.as_dict() for choice in choices]
    if budget is not None:
        payload["plan"] = plan_memory(spec, budget, devices=devices, max_nodes=max_nodes).model_dump(mode="json")
    return payload


def remote_payload(args: argparse.Namespace) -> dict[str, Any]:
    """The service's estimate (and plan, with a budget) in the same shape as :func:`local_payload`."""
    with client_for(args) as client:
        answer = client.estimate(args.spec, gpu_memory_gb=args.gpu_memory, devices=args.devices,
                                 train_rows=args.train_rows, eval_rows=args.eval_rows, queue=args.queue)  # fmt: skip
    payload = dict(answer["estimate"])
    for part in ("plan", "auto"):
        if answer.get(part) is not None:
            payload[part] = answer[part]
    return payload


@readable_errors
def run_remote(args: argparse.Namespace) -> int:
    """``trainjobs estimate SPEC --remote``: the service's answer, rendered as a local one."""
    payload = remote_payload(args)
    print(json.dumps(payload) if args.json else render_estimate(payload))
    return fit_exit_code(payload)


# Exit statuses with a budget: the spec fits / only a plan entry fits / nothing the planner tried fits.
EXIT_FITS, EXIT_PLAN_FITS, EXIT_NOTHING_FITS = 0, 3, 4


def fit_exit_code(payload: dict[str, Any]) -> int:
    """0 when the spec fits (or no budget was given), 3 when only a plan entry fits, 4 when nothing does."""
    plan = payload.get("plan")
    if payload.get("fits") is not False or plan is None:
        return EXIT_FITS
    return EXIT_PLAN_FITS if plan.get("entries") else EXIT_NOTHING_FITS


def run(args: argparse.Namespace) -> int:
    """Print the estimate; exit as :func:`fit_exit_code` says, or 2 for a spec or model that cannot be estimated."""
    if args.remote:
        return run_remote(args)
    if args.train_rows is not None:  # the rate is learned from a queue's finished jobs: the service has them
        print("error: --train-rows: the time estimate is the service's; add --remote", file=sys.stderr)
        return 2
    from trainer_core.spec import SpecError

    try:
        payload = local_payload(args.spec, args.gpu_memory, args.devices, args.max_nodes)
    except SpecError as exc:
        for err in exc.errors:
            print(f"error: {err.field}: {err.message}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(payload) if args.json else render_estimate(payload))
    return fit_exit_code(payload)
