"""The base every section of the job spec builds on, below both :mod:`trainer_core.spec` and
:mod:`trainer_core.optimizers` (which owns the optimizer section) so neither imports the other back.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic_core import PydanticCustomError


def combination_error(field: str, message: str) -> PydanticCustomError:
    """An error for a rule that spans fields; ``field`` is the dotted path users should fix."""
    return PydanticCustomError("invalid_combination", "{field}: " + message, {"field": field})


class StrictModel(BaseModel):
    """A spec section: unknown fields are rejected, never silently ignored. Every number is finite (JSON's
    ``1e400`` and ``Infinity``, YAML's ``.inf``): an infinite epoch count crashed the run with OverflowError."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)
