"""``trainjobs estimate SPEC``: will this job fit, and what to change if it does not.

The command computes one JSON-able payload (:func:`local_payload`) and renders it
(:func:`render_payload`), so another source of the same payload (the service's estimate endpoint)
can reuse the rendering.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

UNITS = {"": 1024**3, "g": 1024**3, "gib": 1024**3, "gb": 1000**3, "m": 1024**2, "mib": 1024**2, "mb": 1000**2}


def parse_memory(text: str) -> float:
    """A memory size such as ``24GiB``, ``80GB``, ``24`` (GiB) or ``512MiB``, returned in GiB."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in UNITS or float(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(f"--gpu-memory: expected a size like 24GiB, 80GB or 512MiB, got {text!r}")
    return float(match.group(1)) * UNITS[unit] / 1024**3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``estimate`` (a ``--remote`` option may be added next to them)."""
    parser.add_argument("spec", metavar="SPEC", help="job spec file (YAML or JSON)")
    parser.add_argument(
        "--gpu-memory",
        type=parse_memory,
        default=None,
        metavar="SIZE",
        help="per-device budget, e.g. 24GiB or 80GB; lists the settings that fit",
    )
    parser.add_argument("--devices", type=int, default=None, metavar="N", help="number of devices (DDP)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--remote", action="store_true", help="ask the service ($TRAINJOBS_URL, $TRAINJOBS_API_KEY) instead"
    )


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("estimate", help="estimate per-device GPU memory of a job spec")
    add_arguments(parser)
    parser.set_defaults(func=run)


def local_payload(spec_path: str, gpu_memory_gb: float | None, devices: int | None) -> dict[str, Any]:
    """The estimate (and the plan when a budget is known) as one JSON-able object."""
    from trainer_core.memory import estimate_memory, plan_memory
    from trainer_core.spec import load_spec_file

    spec = load_spec_file(spec_path)
    estimate = estimate_memory(spec, devices=devices, gpu_memory_gb=gpu_memory_gb)
    payload: dict[str, Any] = estimate.model_dump(mode="json")
    budget = gpu_memory_gb if gpu_memory_gb is not None else spec.resources.gpu_memory_gb
    if budget is not None:
        payload["plan"] = plan_memory(spec, budget, devices=devices).model_dump(mode="json")
    return payload


def render_payload(payload: dict[str, Any]) -> str:
    """A readable table of the parts, the total, and the plan when there is one."""
    from trainer_core.memory import TOTAL_FORMULA
    from trainer_core.memory.estimator import human_bytes

    lines = [
        f"model {payload['model']}: {payload['parameters']:,} parameters "
        f"({payload['trainable_parameters']:,} trainable), {payload['devices']} device(s)",
        "",
        f"{'part':<26} {'bytes':>16} {'size':>12}  formula",
    ]
    for part in payload["parts"]:
        lines.append(f"{part['name']:<26} {part['bytes']:>16,} {human_bytes(part['bytes']):>12}  {part['formula']}")
    total = payload["total_bytes"]
    lines.append(f"{'total per device':<26} {total:>16,} {human_bytes(total):>12}  {TOTAL_FORMULA}")
    if payload.get("gpu_memory_bytes") is not None:
        verdict = "fits" if payload["fits"] else "does NOT fit"
        lines.append(f"\n{verdict} in {human_bytes(payload['gpu_memory_bytes'])}")
    plan = payload.get("plan")
    if plan is not None:
        if plan["entries"]:
            lines.append("\nsettings that fit, fastest first:")
            for i, entry in enumerate(plan["entries"], 1):
                changes = ", ".join(f"{k}={v}" for k, v in entry["changes"].items()) or "(no change)"
                lines.append(f"{i:>3}. {changes}\n     {entry['reason']}")
        else:
            changes = ", ".join(f"{k}={v}" for k, v in plan["minimum_changes"].items()) or "(no change)"
            lines.append(
                f"\nnothing fits; the smallest footprint is {human_bytes(plan['minimum_total_bytes'])} with {changes}"
            )
    return "\n".join(lines)


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
    from trainer_core.spec import SpecError

    if getattr(args, "remote", False):
        from trainjobs.commands.remote import cmd_estimate_remote

        return cmd_estimate_remote(args)
    try:
        payload = local_payload(args.spec, args.gpu_memory, args.devices)
    except SpecError as exc:
        for err in exc.errors:
            print(f"error: {err.field}: {err.message}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(payload) if args.json else render_payload(payload))
    return fit_exit_code(payload)
