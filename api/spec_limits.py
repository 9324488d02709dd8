"""Bounds on a submitted document that the spec's own types do not express.

- No NUL character (``\\u0000``) in any string or key: PostgreSQL's JSONB refuses it, and the
  insert failed with a 500 after every other check had passed.
- At most ``MAX_DEPTH`` levels of nesting (free-form parts such as ``model.config``): pydantic's
  serializer stops at ~255 levels, another 500; real configs nest a handful of levels.
- Every number finite: JSON's ``1e400`` parses as infinity (``Infinity`` and ``NaN`` as themselves),
  which a spec stored as null and a run crashed on; the typed fields refuse them too (``allow_inf_nan``),
  this walk covers the free-form parts (a ``model.config`` value).

The total size is bounded before parsing by the body limit (``TRAINJOBS_MAX_JSON_KB``). The walk is
iterative, so a deep document cannot exhaust the stack of the check meant to refuse it.

- ``resources.max_runtime_minutes`` at most ``TRAINJOBS_MAX_JOB_HOURS`` (:func:`runtime_limited`).
"""

from __future__ import annotations

import math
from typing import Any

from api.problems import validation_problem
from trainer_core.spec import FieldError, JobSpec, SpecError

MAX_DEPTH = 32


def document_errors(doc: Any, prefix: str = "") -> list[FieldError]:
    """Every NUL-carrying string, non-finite number and part nested past ``MAX_DEPTH``, by dotted field path."""
    errors: list[FieldError] = []
    stack: list[tuple[Any, str, int]] = [(doc, prefix, 0)]
    while stack:
        value, path, depth = stack.pop()
        if isinstance(value, str):
            if "\x00" in value:
                errors.append(FieldError(path, "must not contain the NUL character (\\u0000)", "nul_character"))
            continue
        if isinstance(value, float) and not math.isfinite(value):
            errors.append(FieldError(path, f"must be a finite number, not {value}", "finite_number"))
            continue
        if not isinstance(value, dict | list):
            continue
        if depth >= MAX_DEPTH:
            errors.append(FieldError(path, f"nested deeper than {MAX_DEPTH} levels", "too_deep"))
            continue
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            child = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and "\x00" in key:
                errors.append(FieldError(child, "keys must not contain the NUL character (\\u0000)", "nul_character"))
            stack.append((item, child, depth + 1))
    return sorted(errors, key=lambda e: e.field)


def within_bounds(doc: Any) -> bool:
    """Whether ``doc`` breaks no bound: :func:`document_errors`'s walk without the field paths, which
    cost more than the check itself on every request (nearly all of which break nothing)."""
    stack: list[tuple[Any, int]] = [(doc, 0)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            if "\x00" in value:
                return False
        elif isinstance(value, float):
            if not math.isfinite(value):
                return False
        elif isinstance(value, dict):
            if depth >= MAX_DEPTH or any(isinstance(key, str) and "\x00" in key for key in value):
                return False
            stack.extend((item, depth + 1) for item in value.values())
        elif isinstance(value, list):
            if depth >= MAX_DEPTH:
                return False
            stack.extend((item, depth + 1) for item in value)
    return True


def check_document(doc: Any, prefix: str = "") -> Any:
    """``doc`` unchanged, or a 422 Problem naming each field that breaks a bound.

    A Problem, not a ValueError: raised from a pydantic ``before`` validator it passes through
    validation untouched (a ValueError would become one error with no field path).
    """
    if within_bounds(doc):
        return doc
    errors = document_errors(doc, prefix)
    if errors:
        raise validation_problem(errors, title="Invalid job spec")
    return doc


def runtime_limited(spec: JobSpec, max_job_hours: float) -> JobSpec:
    """``spec`` with a run time limit of at most ``max_job_hours`` (``TRAINJOBS_MAX_JOB_HOURS``).

    A longer ``resources.max_runtime_minutes`` is a 422 naming it; a spec without one gets the ceiling
    as its limit, stored with the job. So no run outlives the broker's visibility timeout (the ceiling
    plus an hour), after which the broker would deliver the job again while it still runs.
    """
    ceiling = max_job_hours * 60
    given = spec.resources.max_runtime_minutes
    if given is None:
        resources = spec.resources.model_copy(update={"max_runtime_minutes": ceiling})
        return spec.model_copy(update={"resources": resources})
    if given > ceiling:
        message = f"at most {ceiling:g} minutes on this service (TRAINJOBS_MAX_JOB_HOURS={max_job_hours:g})"
        raise SpecError([FieldError("resources.max_runtime_minutes", message, "less_than_equal")])
    return spec
