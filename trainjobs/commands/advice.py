"""What the CLI prints beside a refusal for memory: the estimate, the budget, and the plan's best entries."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

OVER_BUDGET = "urn:trainjobs:problem:over-budget"
SHOWN_ENTRIES = 3


def _gib(size: Any) -> str:
    return f"{float(size) / (1 << 30):.2f} GiB" if isinstance(size, int | float) else "?"


def _changes(changes: Mapping[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in changes.items()) or "(no change)"


def over_budget_lines(body: Mapping[str, Any]) -> list[str]:
    """Readable lines for an over-budget problem body; empty for any other problem."""
    if body.get("type") != OVER_BUDGET:
        return []
    estimate = body.get("estimate") or {}
    plan = body.get("plan") or {}
    lines = [f"estimate: {_gib(estimate.get('total_bytes'))} per device; budget: {_gib(plan.get('budget_bytes'))}"]
    entries = plan.get("entries") or []
    if entries:
        lines.append(f"settings that fit, fastest first (top {min(len(entries), SHOWN_ENTRIES)} of {len(entries)}):")
        for i, entry in enumerate(entries[:SHOWN_ENTRIES], 1):
            lines.append(f"  {i}. {_changes(entry.get('changes') or {})}: {entry.get('reason', '')}")
    elif plan:
        lines.append(
            f"nothing fits; the smallest footprint found is {_gib(plan.get('minimum_total_bytes'))} "
            f"with {_changes(plan.get('minimum_changes') or {})}"
        )
    return lines
