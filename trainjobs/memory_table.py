"""The memory estimate as a table for a terminal, from its JSON form (local or the service's answer).

``trainjobs estimate`` renders what it computed itself and ``trainjobs estimate --remote`` what the
service sent back, with this one function. It reads only the JSON, so the lean client (no torch)
can render the service's answer.
"""

from __future__ import annotations

from typing import Any


def human_bytes(n: int) -> str:
    """``n`` bytes in binary units, e.g. ``1.50 GiB`` (as ``trainer_core.memory.estimator.human_bytes``,
    which the lean client cannot import: that package loads torch)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def render_estimate(payload: dict[str, Any]) -> str:
    """A readable table of the parts, the total, and the plan when there is one."""
    lines = [
        f"model {payload['model']}: {payload['parameters']:,} parameters "
        f"({payload['trainable_parameters']:,} trainable), {payload['devices']} device(s)",
        "",
        f"{'part':<26} {'bytes':>16} {'size':>12}  formula",
    ]
    for part in payload["parts"]:
        lines.append(f"{part['name']:<26} {part['bytes']:>16,} {human_bytes(part['bytes']):>12}  {part['formula']}")
    total = payload["total_bytes"]
    total_formula = payload.get("total_formula") or ""
    lines.append(f"{'total per device':<26} {total:>16,} {human_bytes(total):>12}  {total_formula}".rstrip())
    if payload.get("gpu_memory_bytes") is not None:
        verdict = "fits" if payload["fits"] else "does NOT fit"
        lines.append(f"\n{verdict} in {human_bytes(payload['gpu_memory_bytes'])}")
    if payload.get("time"):
        lines.extend(render_time(payload["time"]))
    if payload.get("auto"):
        lines.append("\nchosen for auto:")
        lines.extend(f"  {choice['field']} = {choice['value']}  ({choice['why']})" for choice in payload["auto"])
    plan = payload.get("plan")
    if plan is not None:
        lines.extend(render_plan(plan))
    return "\n".join(lines)


def render_time(time: dict[str, Any]) -> list[str]:
    """The time part: the counted work, and the predicted seconds (and cost) when the queue can time it."""
    lines = [f"\ntime: {time['steps']} steps, {time['train_samples']} training samples of "
             f"{time['tokens_per_sample']} positions, {(time['train_flops'] + time['eval_flops']) / 1e12:.3g} TFLOP"]
    if time.get("seconds") is not None:
        low, high = time["seconds_p10"], time["seconds_p90"]
        cost = f", cost {time['cost']:.4g}" if time.get("cost") is not None else ""
        lines.append(f"  predicted {time['seconds']:.0f} s (p10-p90 {low:.0f}-{high:.0f} s){cost}")
    if time.get("note"):
        lines.append(f"  {time['note']}")
    return lines


def render_plan(plan: dict[str, Any]) -> list[str]:
    """The planner's fitting settings, fastest first, or the smallest footprint when nothing fits."""
    if not plan["entries"]:
        changes = ", ".join(f"{k}={v}" for k, v in plan["minimum_changes"].items()) or "(no change)"
        return [f"\nnothing fits; the smallest footprint is {human_bytes(plan['minimum_total_bytes'])} with {changes}"]
    lines = ["\nsettings that fit, fastest first:"]
    for i, entry in enumerate(plan["entries"], 1):
        changes = ", ".join(f"{k}={v}" for k, v in entry["changes"].items()) or "(no change)"
        lines.append(f"{i:>3}. {changes}\n     {entry['reason']}")
    return lines
