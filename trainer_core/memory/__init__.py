"""Memory estimator and planner: know before a job starts whether it fits, and what to change if not.

See docs/memory.md for the formulas and their sources.
"""

from trainer_core.memory.catalog import catalog_entry, catalog_ids
from trainer_core.memory.estimator import TOTAL_FORMULA, MemoryEstimate, MemoryPart, estimate_memory
from trainer_core.memory.parameters import UnknownModelError
from trainer_core.memory.planner import Plan, PlanEntry, plan_memory

__all__ = [
    "TOTAL_FORMULA",
    "MemoryEstimate",
    "MemoryPart",
    "Plan",
    "PlanEntry",
    "UnknownModelError",
    "catalog_entry",
    "catalog_ids",
    "estimate_memory",
    "plan_memory",
]
